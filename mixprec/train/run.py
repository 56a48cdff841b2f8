"""One ``fit()`` call around the loop: the run opened before the first step (its folder, a
checkpoint restored, its logs, the audit, the profiler), the context the steps run in (a lost peer
is one line, Ctrl-C/SIGTERM saves then stops, the run's health counts the steps as they conclude),
what the run does after its last step, and the :class:`FitResult` it returns; and how many steps
it takes (:func:`total_steps`).

:func:`open_run` sets the trainer's run state (``config``, ``run_dir``, ``checkpointer``, ``step``,
``epoch``, ``events``, ``profiler``): the attributes ``Trainer.__init__`` declares for it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixprec.amp import StuckLossScaleWarning
from mixprec.errors import ConfigError
from mixprec.monitor import StuckScaleWarning, audit, audit_after_first_step
from mixprec.monitor.profile import StepProfiler
from mixprec.runs.checkpointer import Checkpointer
from mixprec.train.checkpoints import open_run_dir, refuse_another_models_run, restore
from mixprec.train.config import FitConfig
from mixprec.train.ending import warmup_not_left
from mixprec.train.finished import finished_run
from mixprec.train.health import RunHealth
from mixprec.train.hooks import ProfilerHook
from mixprec.train.run_log import RunLog
from mixprec.train.signals import StopRequest
from mixprec.train.step import Batch, StepOutput, micro_batch_groups

__all__ = ["FitResult", "Run", "total_steps", "open_run", "audit_first_step", "running", "result",
           "nothing_to_train"]


@dataclass
class FitResult:
    run_dir: Path | None
    steps: int
    skipped_steps: int
    final_loss: float | None
    final_val_loss: float | None
    policy: str
    """What ran (``Precision.layers.ran``): the mode, ``32-true+plan (8 nvfp4, 1 fp32)`` for a plan, or
    ``fp8-tensorwise+switched (5 bf16)`` when layers changed format while training (the guard)."""
    nothing_to_train: bool = False
    """The resumed run was already at its last step: this call built, trained and wrote nothing,
    and the fields above are what the run's files record (train/finished.py)."""


@dataclass
class Run:
    """What the loop of one ``fit()`` call reads besides the trainer."""

    total: int                         # the step the run ends at
    resumed: bool                      # it continued a checkpoint
    log: RunLog                        # metrics rows, events, the interval meter
    health: RunHealth                  # the verdict on the run (skips counted as steps conclude)
    groups: Iterator[tuple[int, list[Batch]]]   # (epoch, the micro-batches of a step), endless
    audit_first_step: bool = False     # audit what the first step changed (the step from 0)
    stop: StopRequest | None = None    # Ctrl-C/SIGTERM asked to stop (inside :func:`running`)


def total_steps(train_loader: Any, cfg: FitConfig) -> int:
    """The steps the run takes: ``max_steps``, or ``epochs`` of the loader's full steps."""
    try:
        steps_per_epoch = len(train_loader) // cfg.grad_accum_steps  # type: ignore[arg-type]
    except TypeError:
        steps_per_epoch = None
    if cfg.max_steps is not None:
        return cfg.max_steps
    if steps_per_epoch:
        return cfg.epochs * steps_per_epoch
    if steps_per_epoch is None:
        raise ConfigError("the training data has no length and max_steps is not set; set "
                          "max_steps")
    raise ConfigError(f"the training data gives no full step ({len(train_loader)} batches "
                      f"for grad_accum_steps={cfg.grad_accum_steps}); use more data or a "
                      "smaller batch")


def open_run(trainer: Any, train_loader: Any, total: int, resume: str | Path | bool | None) -> Run:
    """Open ``trainer``'s run (``prepare()`` has built its parts): the run folder claimed, the
    checkpoint ``resume`` names restored, ``config.toml`` and the start lines written, the audit
    of the model as set up, the profiler as the first step hook, the progress clock started."""
    cfg = trainer.config
    notes = trainer._notes
    trainer.config, resume, trainer.run_dir, trainer._lock = open_run_dir(
        cfg, resume, trainer.strategy, trainer.precision, notes=notes)
    cfg = trainer.config
    trainer.checkpointer = Checkpointer(trainer.strategy, trainer.run_dir, keep_last=cfg.keep_last,
                                        export_hf=cfg.export_hf, model=trainer.model)
    loader_resumed = False
    if resume:
        refuse_another_models_run(cfg, trainer.run_dir, resume, trainer.raw_model)
        trainer.step, trainer.epoch, loader_resumed = dataclasses.astuple(restore(
            trainer, resume, train_loader, total, group_settings=trainer._group_settings,
            own_scheduler=trainer._user_scheduler is None, notes=notes))
    log = RunLog.open(trainer, train_loader, total, resumed=bool(resume), model=trainer.raw_model,
                      optimizer=trainer._user_optimizer, notes=notes)
    trainer.events = log.events
    health = RunHealth(cfg, start_step=trainer.step)
    trainer.model.train()
    if cfg.audit:
        log.events.findings(audit(trainer.strategy.unwrap(trainer.model), precision=trainer.precision,
                                  optimizer=trainer.optimizer, device=trainer.device), trainer.step)
    trainer.profiler = (StepProfiler(cfg.profile, trainer.run_dir, device=trainer.device,
                                     write=trainer.strategy.is_main) if cfg.profile else None)
    if trainer.profiler is not None:
        trainer.hooks.insert(0, ProfilerHook(trainer.profiler))
    log.events.open_progress(total, trainer.step)
    # A loader restored from the checkpoint already knows its epoch and position.
    groups = micro_batch_groups(train_loader, cfg.grad_accum_steps, epoch=trainer.epoch,
                                resumed=loader_resumed)
    return Run(total, bool(resume), log, health, groups, audit_first_step=cfg.audit and trainer.step == 0)


def audit_first_step(trainer: Any, run: Run) -> None:
    """The audit's findings about what the run's first step changed (once)."""
    trainer.settle()
    run.log.events.findings(audit_after_first_step(trainer.strategy.unwrap(trainer.model)), trainer.step)
    run.audit_first_step = False


@contextlib.contextmanager
def running(trainer: Any, run: Run) -> Iterator[Run]:
    """The context the steps of ``run`` run in (``run.stop`` set inside), and after the last one
    (no exception): the update in flight settled, the hooks closed, a Hugging Face model exported,
    a schedule still in warm-up said. The logs close however it ends."""
    try:
        # A lost peer ends the job with one line, not a hang; Ctrl-C/SIGTERM saves, then stops.
        with trainer.strategy.guard(), StopRequest(announce=trainer.strategy.is_main) as stop, \
                warnings.catch_warnings():
            if trainer.scale_watch is not None:
                # The watch's hook reports a stuck scale (terminal once, events.jsonl each
                # step): its own warning and the scaler's would repeat it as raw Python
                # warnings, one per step, with a file path.
                warnings.filterwarnings("ignore", category=StuckLossScaleWarning)
                warnings.filterwarnings("ignore", category=StuckScaleWarning)
            run.stop = stop
            trainer.outcomes.begin(run.health)
            yield run
        trainer.settle()
        for hook in trainer.hooks:
            hook.close()                              # the profiler: a run shorter than its steps
        trainer.checkpointer.export_final(trainer.model)    # a Hugging Face model: RUN_DIR/hf
        if (line := warmup_not_left(trainer, own_scheduler=trainer._user_scheduler is None)) is not None:
            run.log.events.note(line, trainer.step, "schedule")
    finally:
        trainer.outcomes.end()
        run.stop = None
        run.log.close()


def result(trainer: Any, run: Run, last_out: StepOutput | None, last_val: float | None) -> FitResult:
    """What ``fit()`` returns once ``run`` ended."""
    final_loss = float(last_out.loss) if last_out is not None else None
    return FitResult(trainer.run_dir, trainer.step, trainer.precision.scaler.num_skipped_steps, final_loss,
                     last_val, trainer.precision.layers.ran())


def nothing_to_train(trainer: Any, total: int, resume: str | Path | bool | None) -> FitResult | None:
    """A resume of a run already at ``total`` steps (train/finished.py): the one line said (rank
    0), ``trainer``'s step and run folder the run's, and what its files record; None: train."""
    finished = finished_run(trainer.config.run_dir, resume, total)
    if finished is None:
        return None
    if trainer.strategy.is_main:
        print(f"[mixprec] {finished.line()}", file=sys.stderr)
    trainer.step, trainer.run_dir = finished.step, finished.run_dir
    return FitResult(finished.run_dir, finished.step, finished.skipped_steps, finished.final_loss,
                     finished.final_val_loss, finished.precision, nothing_to_train=True)
