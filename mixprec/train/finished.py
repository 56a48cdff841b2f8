"""A resume with nothing to train: the run the checkpoint belongs to is already at the step this
run ends at. One rule for ``fit()`` and ``mixprec train --resume`` (which asks it before it builds
anything): nothing is built or written, one line says so, and the result is what the run's files
say it has (its steps, skipped steps, last training and validation losses, precision). A
checkpoint *past* the end is refused in one line, before anything is written."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mixprec import hints
from mixprec.errors import ConfigError
from mixprec.runs import checkpoint as ckpt
from mixprec.runs.metrics import is_finite_number, read_metrics
from mixprec.runs.read import read_run_config

__all__ = ["Finished", "finished_run", "past_the_end"]


@dataclass(frozen=True)
class Finished:
    """A finished run, as its files record it."""

    run_dir: Path
    step: int                       # its checkpoint's step: the step this run would end at
    skipped_steps: int              # metrics.csv's skipped_total at that step (0: no row says)
    final_loss: float | None        # the training loss of its last metrics row up to ``step``
    final_val_loss: float | None    # its last validation loss up to ``step``
    precision: str                  # config.toml's resolved precision ('' when it names none)

    def line(self) -> str:
        """The one line said instead of a run (a hint in the caller's form: command or fit())."""
        val = f" (final validation loss {self.final_val_loss:.4f})" if self.final_val_loss is not None else ""
        return (f"nothing to train: run {self.run_dir} already finished at step {self.step} of "
                f"{self.step}{val}; give a larger max_steps= to continue: "
                f"{hints.resume(self.run_dir, max_steps=2 * self.step)}")


def past_the_end(step: int, total: int) -> ConfigError:
    """The refusal of a checkpoint at ``step`` for a run that ends at ``total`` (< ``step``)."""
    return ConfigError(f"the checkpoint is at step {step}, past max_steps={total}; "
                       f"resume with max_steps={step} or more")


def finished_run(run_dir: str | Path | None, resume: str | Path | bool | None,
                 total: int | None) -> Finished | None:
    """The run a resume continues when its checkpoint is at ``total`` steps already (None: there
    is training to do, no resume, no complete checkpoint, or ``total`` is not known yet).

    ``resume``: True (``run_dir``'s newest checkpoint) or a run folder, its ``checkpoints/`` folder
    or one step folder, as ``fit()`` takes it. Reads folder names, ``metrics.csv`` and
    ``config.toml`` only; raises :class:`ConfigError` for a checkpoint past ``total``."""
    if not resume or total is None:
        return None
    source = (Path(run_dir) if run_dir is not None else None) if resume is True else Path(resume)
    if source is None:
        return None
    step = ckpt.checkpoint_step(source)
    if step is None or step < total:
        return None
    if step > total:
        raise past_the_end(step, total)
    run = ckpt.run_of_checkpoint(source) or source
    try:
        rows = [r for r in read_metrics(run) if r.get("step") is not None and r["step"] <= step]
    except (OSError, ValueError):
        rows = []
    last = lambda key: next((r[key] for r in reversed(rows) if is_finite_number(r.get(key))),  # noqa: E731
                            None)
    skipped = next((r["skipped_total"] for r in reversed(rows) if r.get("skipped_total") is not None), 0)
    precision = read_run_config(run).get("precision")
    return Finished(run, step, int(skipped), last("loss"), last("val_loss"),
                    precision if isinstance(precision, str) else "")
