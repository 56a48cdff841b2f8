"""What both integrations share: the ``Precision`` they are given, a scheduler that does not step
after a skipped optimizer step, and the record of a run (console lines, a mixprec run folder).

No framework is imported here.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.precision import Precision
from mixprec.errors import ConfigError
from mixprec.monitor import NonFiniteEvent, audit, locate_nonfinite
from mixprec.monitor.trace import RngState, gather_origins
from mixprec.runs.events import RunEvents
from mixprec.runs.metrics import MetricsLogger
from mixprec.runs.run_dir import claim_run_dir, deleted_note, holds_a_run
from mixprec.train.step import StepOutput
from mixprec.train.schedules import move_scheduler, replace_step

__all__ = ["as_precision", "StepIfTaken", "Host", "RunRecord", "move_scheduler", "copy_hyperparameters",
           "route_to_masters", "replace_step"]


def as_precision(precision: Precision | str | bool | None, *, owner: str,
                 **options: Any) -> Precision:
    """``precision`` itself when it is a ready :class:`Precision` (then no other option may be
    given: they belong to it), else ``Precision(precision, **options)``."""
    given = {k: v for k, v in options.items() if v is not None}
    if isinstance(precision, Precision):
        if given:
            raise ConfigError(f"{owner}: {', '.join(sorted(given))} with a ready Precision; pass "
                              f"them to it, mixprec.Precision(mode, {sorted(given)[0]}=...)")
        return precision
    return Precision("auto" if precision is None else precision, **given)


def copy_hyperparameters(optimizer: Any, masters: Any) -> None:
    """The user's optimizer's group settings (lr, betas, weight decay: what schedulers change)
    onto its masters' groups, which are the ones stepped."""
    for mine, theirs in zip(optimizer.param_groups, masters.param_groups):
        for key, value in mine.items():
            if key != "params":
                theirs[key] = value


def route_to_masters(optimizer: Any, masters: Any) -> None:
    """From now on ``optimizer`` (the one the user or a framework holds) is a view of its FP32-master
    optimizer ``masters``: its ``zero_grad`` clears the masters' step too, and its state dict is
    theirs (a checkpoint holds the masters)."""
    optimizer._mixprec_masters = masters
    optimizer.zero_grad = masters.zero_grad
    optimizer.state_dict = masters.state_dict

    def load_state_dict(state_dict: dict[str, Any]) -> None:
        masters.load_state_dict(state_dict)
        for mine, theirs in zip(optimizer.param_groups, masters.param_groups):
            mine.update({k: v for k, v in theirs.items() if k != "params"})

    optimizer.load_state_dict = load_state_dict
    copy_hyperparameters(optimizer, masters)


class StepIfTaken:
    """An LR scheduler that does not step after a skipped optimizer step.

    ``fit()`` steps its scheduler only when ``Precision.step`` took the step; a framework steps
    its scheduler itself, so the integrations hand it this wrapper instead. Everything else
    (``state_dict``, ``get_last_lr``, ``optimizer``, ...) is the wrapped scheduler's.
    """

    def __init__(self, scheduler: Any, precision: Precision) -> None:
        self.scheduler = scheduler
        self.precision = precision

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.precision.scaler.last_step_skipped:
            return                          # the weights did not move: neither does the schedule
        self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        if name in ("scheduler", "precision"):      # not set yet (copy, pickle)
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"StepIfTaken({self.scheduler!r})"


class Host:
    """What the run record needs to know of the process it runs in (a framework's rank and
    device); :class:`RunEvents` prints the class name as the strategy."""

    def __init__(self, device: torch.device | str, *, rank: int = 0, world_size: int = 1) -> None:
        self.device = torch.device(device)
        self.rank = rank
        self.world_size = world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _toml(config: dict[str, Any]) -> str:
    lines = []
    for key, value in config.items():
        if value is None:
            continue
        lines.append(f"{key} = {json.dumps(value)}")   # JSON strings/numbers/bools are TOML too
    return "\n".join(lines) + "\n"


class RunRecord:
    """The console lines and (with ``run_dir``) the mixprec run folder of a framework's run:
    ``config.toml``, ``metrics.csv``, ``events.jsonl``, ``tb/``, the files ``mixprec report``
    reads. ``resume_step``: the step a resumed run continues from (its rows after it are dropped);
    a new run refuses a folder that holds one unless ``overwrite``. ``numbered`` (a default folder
    the user did not name, e.g. the Hugging Face Trainer's ``OUTPUT_DIR/mixprec``): a new run
    finds it holding an earlier run, as when a script is run again into the same output folder,
    and goes on in the first free ``-2``, ``-3``, ... sibling instead, saying so in one line; the
    earlier run is left as it was.
    """

    def __init__(self, precision: Precision, host: Host, *, run_dir: str | Path | None,
                 resume_step: int | None = None, overwrite: bool = False,
                 config: dict[str, Any] | None = None, numbered: bool = False,
                 overwrite_hint: str | None = None) -> None:
        self.precision = precision
        self.host = host
        self.run_dir: Path | None = None
        self.earlier_run: Path | None = None
        """The default folder an earlier run holds when this one went on in a numbered sibling."""
        if run_dir is not None and host.is_main and numbered and resume_step is None and not overwrite \
                and holds_a_run(Path(run_dir)):
            self.earlier_run = Path(run_dir)
            run_dir = next(p for n in range(2, 100_000)
                           if not (p := Path(f"{run_dir}-{n}")).exists() or (p.is_dir() and not any(p.iterdir())))
        deleted: list[str] = []
        if run_dir is not None and host.is_main:
            self.run_dir = claim_run_dir(run_dir, precision=precision.recipe.label, deleted=deleted,
                                         resume=resume_step is not None and Path(run_dir).is_dir(),
                                         overwrite=overwrite,
                                         ways_out="resume it from your framework's own checkpoint "
                                                  "(it continues this folder), choose another run_dir, "
                                                  + (f"or pass {overwrite_hint} to write over it"
                                                     if overwrite_hint else "or delete the folder to start over"))
            (self.run_dir / "config.toml").write_text(   # the [recipe] table last: every choice
                _toml({"precision": precision.name, **(config or {})}) + "\n" + precision.recipe.to_toml(),
                encoding="utf-8")
        self.logger = MetricsLogger(self.run_dir or ".", enabled=self.run_dir is not None,
                                    resume_step=resume_step)
        self.events = RunEvents(host, precision, self.logger, progress=False)
        if deleted:
            print(f"[mixprec] {deleted_note(self.run_dir, deleted)}", file=sys.stderr)
        if self.earlier_run is not None:
            print(f"[mixprec] {self.earlier_run} holds an earlier run (left as it was); this run's folder is "
                  f"{self.run_dir}" + (f" ({overwrite_hint} writes over the earlier one instead)"
                                       if overwrite_hint else ""), file=sys.stderr)
        self.nonfinite: list[NonFiniteEvent] = []
        """Every traced non-finite step of this run, in order."""

    def start(self, model: nn.Module, *, step: int, total: int, optimizer: Any = None,
              run_audit: bool = True) -> None:
        """The start lines (precision, layer formats, run folder) and the audit's findings."""
        self.events.start(model=model, step=step, total=total, run_dir=self.run_dir or "none (pass run_dir= to write one)",
                          fp8_report=self.precision.layers.fp8_report)
        if run_audit:
            self.events.findings(audit(model, precision=self.precision, optimizer=optimizer,
                                       device=self.host.device), step)

    def trace_skip(self, model: nn.Module, run_step: Callable[[], torch.Tensor | None], *,
                   step: int, scale_before: float, rng_state: RngState | None) -> NonFiniteEvent | None:
        """Replay a skipped step with hooks (``run_step``: forward and backward of its batches,
        the loss multiplied by ``scale_before``) and log where its first inf/NaN appeared. Under
        ``torch.distributed`` every rank must call it (the origins are gathered)."""
        event = locate_nonfinite(model, run_step, loss_scale=scale_before, step=step,
                                 rng_state=rng_state)
        # Every rank skipped (the scaler agrees across ranks); the one whose batch made the
        # inf/NaN may not be the one that logs. A no-op in one process.
        event = gather_origins(event)
        self.skip(step, scale_before, event)
        return event

    def skip(self, step: int, scale_before: float, event: NonFiniteEvent | None) -> None:
        out = StepOutput(loss=torch.zeros(()), grad_norm=None, skipped=True,
                         scale_before=scale_before, tokens=0)
        self.events.skip(step, out, event)
        if event is not None:
            self.nonfinite.append(event)

    def log(self, step: int, **values: Any) -> None:
        """One ``metrics.csv`` row (columns of docs/CONTRACTS.md; others left empty)."""
        precision = self.precision
        self.logger.log(step, loss_scale=precision.scaler.get_scale(), skipped_total=precision.scaler.num_skipped_steps,
                        **values)

    def close(self) -> None:
        self.events.close()
        self.logger.close()
