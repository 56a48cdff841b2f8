"""When the host learns a step's outcome (issue #35): the bookkeeping of a step whose outcome is
still on the device, and what concluding it does.

A step's outcome (taken, or skipped for inf/NaN gradients) may stay on the device until the host
reads it. Concluding it advances the LR schedule if it was taken (a skipped step must not) and,
inside ``fit()``, traces a skip to its origin, records it, calls the step hooks' ``after_step``
and counts it for the run's health.

``fit()`` concludes a step at the first of: the next step's pre-update point (in
``Trainer.train_step``, after that step's backward and before its update: the parameters are
still the concluded step's, and the trace leaves the new gradients, the parameters and the RNG
stream as they were), a log interval, an evaluation, a checkpoint, a stop, the end of the run;
right after each step when the outcome may not lag (:func:`outcome_lags`). So every update runs
at the LR it ran at before the lag, and the counters, rows and events are the same.
"""
from __future__ import annotations

from typing import Any

import torch

from mixprec.monitor import locate_nonfinite
from mixprec.monitor.trace import gather_origins
from mixprec.train.health import RunHealth
from mixprec.train.step import Batch, PendingStep, StepOutput

__all__ = ["Outcomes", "outcome_lags", "watch", "trace_nonfinite", "replay_forward"]


class Outcomes:
    """The trainer's record of the step whose outcome the host has not read yet."""

    def __init__(self) -> None:
        self.pending: PendingStep | None = None
        """The step whose outcome the host has not read yet (:meth:`conclude`)."""
        self.fitting = False
        """Inside ``fit()``: a step's conclusion includes the loop's bookkeeping and may lag."""
        self.rng: Any = None
        """The RNG state before the step ``fit()`` is taking (for the trace of a skip)."""
        self.health: RunHealth | None = None
        """The verdict on the run ``fit()`` is training (skips counted as steps conclude)."""

    def begin(self, health: RunHealth) -> None:
        """``fit()`` starts training: no step pending, conclusions do the loop's bookkeeping."""
        self.pending, self.health, self.fitting = None, health, True

    def end(self) -> None:
        """``fit()`` ends (or fails): steps called on their own conclude as they always did."""
        self.fitting, self.rng = False, None

    def hold(self, step: int, out: StepOutput, batches: list[Batch]) -> None:
        """Step ``step`` was queued: its outcome waits for :meth:`conclude`."""
        self.pending = PendingStep(step, out, batches, self.rng)

    def conclude(self, trainer: Any) -> None:
        """Finish the pending step (a no-op when there is none): read its outcome (the flag's host
        copy; one read for everything queued), advance ``trainer``'s LR schedule if it was taken,
        and inside ``fit()`` :func:`watch` it and count it for the run's health."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        if not pending.out.skipped:          # the host read (of the flag's copy)
            trainer.scheduler.step()         # a skipped step must not advance the LR schedule
        if self.fitting:
            watch(trainer, pending.batches, pending.out, pending.rng)
            self.health.add(pending.step, pending.out.skipped)


def outcome_lags(trainer: Any) -> bool:
    """Whether ``fit()`` may read a step's outcome as late as just before the next step's
    update (True), not right after the step. False with ``trainer.settle_each_step``, with a hook
    that needs the outcome before the next forward (``StepHook.needs_outcome_now``: the
    numerics monitor, the re-planner, the guard), and with delayed-scaling FP8 layers (the
    next forward moves their amax history, which the trace of a skip must replay as it was)."""
    return not (trainer.settle_each_step or any(h.needs_outcome_now for h in trainer.hooks)
                or "fp8-delayed" in trainer.precision.layers.formats.values())


def watch(trainer: Any, batches: list[Batch], out: StepOutput, rng: Any) -> None:
    """When a step concludes: trace a skipped step to its origin (``trainer.trace_nonfinite``),
    record it, then every step hook's ``after_step``."""
    origin = event = None
    if out.skipped:
        # Every rank replays its own micro-batches; rank 0 learns which rank made the inf/NaN.
        event = (gather_origins(trainer.trace_nonfinite(batches, out, rng), trainer.strategy)
                 if trainer.config.trace_nonfinite else None)
        trainer.events.skip(trainer.step, out, event)
        if event is not None:
            origin = f"{event.module} (rank {event.rank})" if event.rank is not None else event.module
    trainer.step_batches, trainer.step_event = batches, event
    for hook in trainer.hooks:
        hook.after_step(trainer, trainer.step, out, origin)


def trace_nonfinite(trainer: Any, micro_batches: list[Batch], out: StepOutput, rng_state: Any):
    """Replay a skipped step's batches with hooks to find the layer that made the inf/NaN
    (``Trainer.trace_nonfinite``).

    Runs on the unwrapped model (no gradient communication) with the RNG state of the original
    step, and leaves parameters, gradients and the RNG stream as they were.
    """
    trainer.settle()
    model = trainer.strategy.unwrap(trainer.model)
    n = len(micro_batches)

    def run_step() -> torch.Tensor:
        total = None
        for batch in micro_batches:
            loss, _ = trainer.batch_loss(model, batch, n)
            trainer.precision.backward(loss, scale=out.scale_before)   # the skipped step's scale
            total = loss.detach() if total is None else total + loss.detach()
        return total

    return locate_nonfinite(model, run_step, loss_scale=out.scale_before, step=trainer.step,
                            rng_state=rng_state)


@torch.no_grad()
def replay_forward(trainer: Any) -> None:
    """The forward of the step just taken again, without backward (``Trainer.replay_forward``,
    the guard's probe: its hooks measure it)."""
    trainer.settle()
    model = trainer.strategy.unwrap(trainer.model)
    for batch in trainer.step_batches:
        trainer.batch_loss(model, batch)
