"""What a ``fit()`` run writes as it trains: its metrics file and ``config.toml`` opened, its
events started (the start lines, then the notes gathered while it was set up), and one metrics
row per logged interval with its terminal line."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mixprec.errors import ConfigError
from mixprec.runs.events import RunEvents
from mixprec.runs.metrics import MetricsLogger
from mixprec.train.meter import IntervalMeter
from mixprec.train.setup import write_run_config
from mixprec.train.step import StepOutput

__all__ = ["RunLog"]


class RunLog:
    """A ``fit()`` run's metrics file, events and interval meter: opened with :meth:`open`, one row
    per logged interval (:meth:`row`), closed by :meth:`close`."""

    def __init__(self, logger: MetricsLogger, events: RunEvents, meter: IntervalMeter, scheduler: Any,
                 *, total: int, log_interval: int) -> None:
        self.logger, self.events, self.meter, self.scheduler = logger, events, meter, scheduler
        self.total, self.log_interval = total, log_interval

    @classmethod
    def open(cls, trainer: Any, train_loader: Any, total: int, *, resumed: bool, model: nn.Module,
             optimizer: torch.optim.Optimizer | None, notes: list[tuple[str, str]]) -> RunLog:
        """The log of ``trainer``'s run at its folder and step: ``config.toml`` written (rank 0;
        ``model`` and ``optimizer``: what the user passed), the start lines said, and ``notes`` said
        and recorded (then cleared). A folder that cannot be written is refused in one line."""
        cfg, run_dir, main = trainer.config, trainer.run_dir, trainer.strategy.is_main
        try:
            logger = MetricsLogger(run_dir, enabled=main, resume_step=trainer.step if resumed else None)
            if main:  # the resolved precision ("auto" means something else on another machine)
                write_run_config(run_dir, cfg, trainer.precision, model=model, optimizer=optimizer,
                                 train_loader=train_loader)
        except OSError as e:
            fix = ("copy the run folder somewhere writable and resume from the copy" if resumed else
                   "free some space or choose another run_dir=PATH")
            raise ConfigError(f"cannot write to the run folder {run_dir} ({e.strerror or e}); "
                              f"{fix}") from None
        events = RunEvents(trainer.strategy, trainer.precision, logger, progress=cfg.progress)
        unwrapped = trainer.strategy.unwrap(trainer.model)
        events.start(model=unwrapped, step=trainer.step, total=total, run_dir=run_dir,
                     fp8_report=trainer.fp8_report,
                     watching=[line for h in trainer.hooks if (line := h.describe())])
        for message, kind in notes:
            events.note(message, trainer.step, kind)
        notes.clear()
        if hasattr(train_loader, "notice"):
            events.data_position(train_loader.notice(resumed_at=trainer.step if resumed else None),
                                 trainer.step)
        meter = IntervalMeter(trainer.strategy, trainer.precision, unwrapped, logger,
                              note=lambda message: events.note(message, trainer.step, "mfu"))
        return cls(logger, events, meter, trainer.scheduler, total=total, log_interval=cfg.log_interval)

    def row(self, out: StepOutput, *, step: int, epoch: int, val_loss: float | None) -> None:
        """One metrics row of the steps since the last one (the meter's mean), and its line
        (``out``: the output of the row's last step)."""
        meter = self.meter
        # The LR the row's last step ran at (the scheduler has moved on to the next one's).
        lr = float(out.lr) if out.lr is not None else self.scheduler.get_last_lr()[0]
        loss = meter.log(out, step=step, epoch=epoch, lr=lr, val_loss=val_loss)
        self.events.interval(step, self.total, loss=loss, val_loss=val_loss,
                             lr=lr, tokens_per_s=meter.last_tps,
                             samples_per_s=meter.last_sps,
                             steps=meter.last_steps, log_interval=self.log_interval)

    def close(self) -> None:
        self.events.close()
        self.logger.close()
