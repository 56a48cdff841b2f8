"""How a ``fit()`` run ends other than by reaching its last step, and what it says when it does:
a stop asked by a signal (saved, then :class:`~mixprec.errors.RunInterrupted`), a diverged run or
a stuck loss scale (:class:`~mixprec.errors.TrainingDiverged`, exit status 3), and the note on a
schedule that never left its warm-up. Each reads the trainer it is given; none changes it."""
from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import torch

from mixprec import hints
from mixprec.errors import RunInterrupted, TrainingDiverged
from mixprec.runs import checkpoint as ckpt
from mixprec.train.health import RunHealth
from mixprec.train.signals import StopRequest
from mixprec.train.step import StepOutput

__all__ = ["stop_agreed", "stop_now", "stop_if_diverged", "warmup_not_left"]


def stop_agreed(trainer: Any, stop: StopRequest, logged: bool) -> int:
    """The signal that asks every rank to stop (0: none): ranks agree at log intervals, on the
    largest signal number any of them got (SIGTERM over SIGINT)."""
    if trainer.strategy.world_size == 1:
        return stop.signum or 0
    return int(trainer.strategy.reduce_max(float(stop.signum or 0))) if logged else 0


def stop_now(trainer: Any, stop: StopRequest, signum: int, saved_to: Path | None) -> None:
    """Record the stop (the step was saved to ``saved_to``; None: the run folder's checkpoints)
    and end the run."""
    path = saved_to or trainer.checkpointer.run_dir
    stop.end()                  # saved: a later signal changes nothing (no abort mid-exit)
    why = signal.Signals(signum).name if stop.requested else \
        f"{signal.Signals(signum).name} on another rank"
    message = (f"stopped by {why} at step {trainer.step}; checkpoint saved in {path}; continue "
               f"with: {hints.resume(trainer.run_dir)}")
    trainer.events.note(message, trainer.step, "interrupted", say=False)
    raise RunInterrupted(message, signum)


def stop_if_diverged(trainer: Any, problem: str | None, last: StepOutput | None = None) -> None:
    """``problem`` (the run's health verdict, or the guard giving up): end the run with one line
    that says the cause (a loss scale stuck at its floor is not divergence) and the way on."""
    if problem is None:
        return
    done = ckpt.list_checkpoints(trainer.run_dir) if trainer.run_dir is not None else []
    lower = float(f"{trainer.config.lr / 2:.3g}")
    where = (f"resume from the last checkpoint before it with a lower lr (the schedule follows "
             f"it): {hints.resume(done[-1][1], checkpoint=True, lr=lower)}"
             if done else "no checkpoint was written before it: start over with a lower lr")
    precision, cfg = trainer.precision, trainer.config
    loss_finite = last is not None and bool(torch.isfinite(torch.as_tensor(last.loss)).all())  # once
    scaler = precision.scaler.config        # the Precision's own (fit()'s, or a ready one's)
    health = trainer.outcomes.health or RunHealth(cfg, start_step=trainer.step)
    cause = health.scaler_cause(scales_loss=precision.recipe.scales_loss, scale=precision.scaler.get_scale(),
                                init_scale=scaler.init_scale, min_scale=scaler.min_scale,
                                growth_interval=scaler.scale_window, hysteresis=scaler.hysteresis,
                                loss_finite=loss_finite, skipped=precision.scaler.num_skipped_steps)
    if cause is not None:
        message = f"training stopped at step {trainer.step}: {problem}; {cause}"
        # not divergence: recorded (and plotted) as what it is; the exit status stays 3
        trainer.events.note(message, trainer.step, "loss_scale_stuck", say=False)
        raise TrainingDiverged(message)
    safer = "" if precision.recipe.compute_dtype == torch.float32 else ", or pick a safer precision"
    message = (f"training diverged at step {trainer.step}: {problem}; lower lr (now "
               f"{cfg.lr:g}), keep clip_grad_norm on{safer}; {where}")
    trainer.events.note(message, trainer.step, "diverged", say=False)
    raise TrainingDiverged(message)


def warmup_not_left(trainer: Any, *, own_scheduler: bool) -> str | None:
    """One line when mixprec's schedule (``own_scheduler``) ended its run still in warm-up (its
    LR never reached the peak): a run shorter than ``warmup_steps``, or one whose steps were
    skipped (a skipped step does not advance the schedule, so a 16-mixed run that skipped every
    step stays at the first warm-up LR). None otherwise, and for a scheduler you passed."""
    cfg, step, scheduler = trainer.config, trainer.step, trainer.scheduler
    if not own_scheduler or cfg.warmup_steps <= 0 or step == 0:
        return None
    taken = int(getattr(scheduler, "last_epoch", cfg.warmup_steps))
    # warmup_steps=1 starts at the peak: there is no warm-up to stay in, even when every step
    # was skipped (it said "never left warm-up ... reached 100 % of the peak").
    if taken >= cfg.warmup_steps or cfg.warmup_steps == 1:
        return None
    skipped = trainer.precision.scaler.num_skipped_steps
    why = (f"{skipped} of its {step} steps were skipped, and a skipped step does not advance it"
           if skipped else f"the run ({step} steps) is shorter than warmup_steps={cfg.warmup_steps}")
    peak = scheduler.base_lrs[0]
    if taken == 0:      # no step taken: the LR was never reached by a step, it waits at the first
        lr = peak * scheduler.lr_lambdas[0](0)
        where = f"no step was taken; it stays at its first warm-up LR {lr:.3g}"
    else:
        lr = peak * scheduler.lr_lambdas[0](taken - 1)     # the last taken step's
        where = f"the LR reached {lr:.3g}"
    return (f"the LR never left warm-up: the schedule advanced {taken} of its {cfg.warmup_steps} "
            f"warm-up steps ({why}); {where}, {100 * lr / peak:.0f} % of the peak {peak:g}")
