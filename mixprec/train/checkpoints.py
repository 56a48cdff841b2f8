"""A run's folder and checkpoints as the loop uses them: the folder claimed (rank 0 locks it), a
save after a step, and continuing a run: what a ``resume`` means (a checkpoint's own run, a run to
start over, another model's run refused), the restore from its checkpoint, and the LR schedule
re-stretched to this run's settings. The files themselves are :mod:`mixprec.runs`'s."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec import hints
from mixprec.errors import CheckpointError, ConfigError
from mixprec.optim.schedule import restretch
from mixprec.precision import Precision
from mixprec.runs import checkpoint as ckpt
from mixprec.runs.read import read_run_config
from mixprec.runs.run_dir import claim_locked_run_dir, deleted_note
from mixprec.strategies import Strategy
from mixprec.train.config import FitConfig
from mixprec.train.finished import past_the_end
from mixprec.train.setup import fit_model_name

__all__ = ["save", "Resumed", "open_run_dir", "claim_run_dir", "resume_into_its_run", "start_over",
           "refuse_another_models_run", "restore", "reschedule"]

Notes = list[tuple[str, str]]


def save(trainer: Any, loader: Any) -> Path | None:
    """Save ``trainer``'s run at its step (rank 0 writes); the folder saved to, or None."""
    trainer.conclude()        # the checkpoint holds the schedule and counters after the step
    trainer.settle()
    return trainer.checkpointer.save(step=trainer.step, epoch=trainer.epoch, model=trainer.model,
                                     optimizer=trainer.optimizer, precision=trainer.precision,
                                     scheduler=trainer.scheduler, loader=loader, config=trainer.config,
                                     replanner=trainer.replanner, guard=trainer.guard)


def open_run_dir(cfg: FitConfig, resume: str | Path | bool | None, strategy: Strategy,
                 precision: Precision, *, notes: Notes) -> tuple[FitConfig, str | Path | bool | None,
                                                                 Path, Any]:
    """``(config, what to resume from, run folder, rank 0's lock on it)``: a checkpoint's own run
    continued (:func:`resume_into_its_run`), a run with no complete checkpoint started over
    (:func:`start_over`: nothing to resume from), the folder claimed."""
    cfg, resume = resume_into_its_run(cfg, resume, notes=notes)
    cfg, again = start_over(cfg, resume, notes=notes)
    resume = None if again else resume
    run_dir, lock = claim_run_dir(strategy, cfg, precision, resume=bool(resume), start_over=again,
                                  notes=notes)
    return cfg, resume, run_dir, lock


def claim_run_dir(strategy: Strategy, cfg: FitConfig, precision: Precision, *, resume: bool,
                  start_over: bool = False, notes: list[tuple[str, str]]) -> tuple[Path, Any]:
    """``(run folder, rank 0's lock on it)``: rank 0 claims (and locks: one folder, one writer) the
    run folder; every rank learns which, or the one-line refusal. ``start_over``: the folder holds
    a run with no complete checkpoint, which a resume begins again from step 0 (its old files are
    replaced)."""
    claim: tuple[str | None, str | None] = (None, None)
    lock = None
    if strategy.is_main:
        deleted: list[str] = []
        try:
            path, lock = claim_locked_run_dir(
                cfg.run_dir, precision=precision.recipe.label, resume=resume and not start_over,
                overwrite=cfg.overwrite or start_over, deleted=deleted)
            claim = (str(path), None)
            if not start_over and (said := deleted_note(path, deleted)):  # (a restart says its own)
                notes.append((said, "overwrite"))
        except ConfigError as e:
            claim = (None, str(e))
    # Rank 0 picked (and made) the folder, or refused it: every rank learns which.
    path, error = strategy.broadcast_object(claim)
    if error is not None:
        raise ConfigError(error)
    run_dir = Path(path)
    hints.set_run_dir(run_dir)
    return run_dir, lock


def resume_into_its_run(cfg: FitConfig, resume: str | Path | bool | None, *,
                        notes: Notes) -> tuple[FitConfig, str | Path | bool | None]:
    """``run_dir`` naming a run's checkpoint (``RUN/checkpoints/step-N``, or ``RUN/checkpoints``)
    with ``resume``: continue RUN from that checkpoint, as ``mixprec train --resume`` does,
    instead of writing a new run inside the checkpoint folder. Returns ``(config, what to resume
    from)``."""
    run = ckpt.run_of_checkpoint(cfg.run_dir) if resume and cfg.run_dir else None
    if run is None:
        return cfg, resume
    given = Path(cfg.run_dir)
    notes.append((f"run_dir={given} is a checkpoint of the run {run}: continuing that run "
                  f"from it (its metrics, events and checkpoints)", "checkpoint"))
    return dataclasses.replace(cfg, run_dir=str(run)), (given if resume is True else resume)


def start_over(cfg: FitConfig, resume: str | Path | bool | None, *,
               notes: Notes) -> tuple[FitConfig, bool]:
    """A resume of a run folder that holds no complete checkpoint (the run stopped before its
    first save, or a second Ctrl-C aborted it): it starts again from step 0 with this run's
    settings, said in one line, instead of a refusal with no way out. Returns ``(config, whether
    it starts over)``."""
    if not resume:
        return cfg, False
    folder = Path(cfg.run_dir) if resume is True and cfg.run_dir else (
        None if resume is True else Path(resume))
    if folder is None or not (folder / "config.toml").is_file() or ckpt.list_checkpoints(folder):
        return cfg, False
    # Saves are atomic (a temp folder renamed into place), so a step folder without its
    # meta.json was damaged after it was written: the run did save. Starting over would
    # replace its metrics and checkpoints; refuse and change nothing.
    damaged = sorted(p.name for p in (folder / "checkpoints").glob("step-*") if p.is_dir()) \
        if (folder / "checkpoints").is_dir() else []
    if damaged:
        raise CheckpointError(
            f"{folder} holds checkpoint folder(s) {', '.join(damaged)} but none is complete "
            f"({ckpt.META_FILE} missing): nothing was changed; restore the missing file, or pass "
            f"{hints.overwrite()} to delete this run and start over")
    notes.append((f"{folder} holds no complete checkpoint (the run stopped before its first "
                  "save): starting it over from step 0 with these settings; its old "
                  "metrics and events are replaced", "restart"))
    return dataclasses.replace(cfg, run_dir=str(folder)), True


def refuse_another_models_run(cfg: FitConfig, run_dir: Path | None, resume: str | Path | bool,
                              model: nn.Module) -> None:
    """A ``fit()`` resume of a folder whose ``config.toml`` says ``fit()`` trained another
    model class there is another run, not this one: refused in one line naming both, before
    a restore fails on whatever differs first (the data's length, a weight's shape)."""
    if hasattr(cfg, "model"):        # mixprec train: its own config names the model
        return
    folder = run_dir if resume is True else (ckpt.run_of_checkpoint(resume) or Path(resume))
    recorded = read_run_config(folder).get("model")
    mine = fit_model_name(model)
    # By class name: the same class imported from another module (a script run as
    # __main__, then imported) is the same model.
    same = lambda a, b: a.rpartition(".")[2] == b.rpartition(".")[2]  # noqa: E731
    if isinstance(recorded, str) and recorded.startswith("fit: ") \
            and not same(recorded[len("fit: "):], mine):
        raise ConfigError(
            f"{folder} holds another run: fit() trained {recorded[len('fit: '):]} there "
            f"(its config.toml), this fit() trains {mine}; choose another run_dir, or pass "
            f"{hints.overwrite()} without resume to delete that run and start over")


@dataclass
class Resumed:
    """Where a restore left the loop."""

    step: int
    epoch: int
    loader_resumed: bool      # the loader knows its epoch and position (no set_epoch at first)


def restore(trainer: Any, resume: str | Path | bool, train_loader: Any, total: int, *,
            group_settings: list[dict[str, Any]], own_scheduler: bool, notes: Notes) -> Resumed:
    """Load the checkpoint ``resume`` names into what ``trainer`` built (model, optimizer,
    precision, scheduler, loader, re-planner, guard); refuse one past ``total`` steps (a finished
    one never gets here: train/finished.py), and re-stretch mixprec's schedule
    (``own_scheduler``) to this run's settings."""
    # This run's peak LR per group, as prepare() built the schedule (cfg.lr for mixprec's
    # optimizer; your optimizer's own LRs for one you passed).
    peaks = list(trainer.scheduler.base_lrs) if own_scheduler else []
    restored = trainer.checkpointer.load(
        trainer.run_dir if resume is True else Path(resume), model=trainer.model,
        optimizer=trainer.optimizer, precision=trainer.precision, scheduler=trainer.scheduler,
        loader=train_loader, replanner=trainer.replanner, guard=trainer.guard)
    step = restored.step
    notes.extend((n, "checkpoint") for n in restored.notes)
    if step > total:
        raise past_the_end(step, total)     # (train/finished.py refuses it before anything is built)
    if own_scheduler:
        reschedule(trainer.scheduler, trainer.optimizer, trainer.config, total, peaks,
                   restored.saved_lr, step=step, group_settings=group_settings, notes=notes)
    return Resumed(step, restored.epoch, restored.loader_resumed)


def reschedule(scheduler: Any, optimizer: torch.optim.Optimizer, cfg: FitConfig, total: int,
               peaks: list[float], saved_lr: list[float], *, step: int,
               group_settings: list[dict[str, Any]], notes: Notes) -> None:
    """After a restore, this run's settings set the learning rate, not the checkpoint's.

    The schedule is a function of the optimizer steps taken: the checkpoint gives their count,
    this run's peak LR (``lr``, or the LRs of an optimizer you passed), ``warmup_steps``,
    ``min_lr_ratio`` and ``max_steps`` give the rest. The next step trains at the LR the new
    schedule has at the steps already taken, and the cosine ends at ``peak * min_lr_ratio`` at
    the new ``max_steps`` (a finished run extended with a larger ``max_steps`` goes back up the
    cosine to where the longer run would be). Unchanged settings give the checkpoint's LR bit
    for bit."""
    lrs = restretch(scheduler, base_lrs=peaks, warmup_steps=cfg.warmup_steps,
                    total_steps=total, min_ratio=cfg.min_lr_ratio)
    # The optimizer's other settings come from this run's config too (they are not a state).
    if len(group_settings) == len(optimizer.param_groups):
        for group, settings in zip(optimizer.param_groups, group_settings):
            group.update(settings)
    if saved_lr and abs(lrs[0] - saved_lr[0]) > 1e-12 * max(abs(saved_lr[0]), 1e-30):
        notes.append((f"resumed schedule: lr {saved_lr[0]:.4g} -> {lrs[0]:.4g} at step "
                      f"{step} (lr={peaks[0]:g}, warmup_steps={cfg.warmup_steps}, "
                      f"min_lr_ratio={cfg.min_lr_ratio:g}, cosine to step {total})", "schedule"))
