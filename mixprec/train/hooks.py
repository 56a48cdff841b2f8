"""Step hooks: the optional per-step helpers of the loop, behind one interface.

A :class:`StepHook` may wrap parts of a training step and act after it; every method defaults to
doing nothing. The trainer keeps them in one list, ``Trainer.hooks``, built by ``prepare()`` and
``fit()`` from the configuration (numerics monitor, re-planner, stuck-scale watch, profiler,
guard), and
calls them in list order; ``step`` is always the number of the step being taken (1-based)::

    with hook.around_step(trainer, step):          # the whole step (the profiler)
        with hook.around_forward(trainer, step):   # every micro-batch's forward and backward
            ...
        with hook.around_update(trainer, step):    # precision.step: unscale, check, clip, step
            ...
    hook.after_step(trainer, step, out, origin)    # out: StepOutput; origin: the traced inf/NaN
                                                   # (trainer.step_event / .step_batches: the same
                                                   # step's traced event and micro-batches)
    hook.close()                                   # the run ended

``after_step`` of step ``t`` runs when the host learns the step's outcome (``Trainer.conclude``):
in steady state just before step ``t + 1``'s update, after its forward and backward (inside its
``around_step`` and ``around_forward``), with the parameters still those of step ``t``'s forward
when it was skipped, and the LR schedule, the loss scale and the counters as right after step
``t``. A hook that must act before the next forward sets ``needs_outcome_now``; ``fit()`` then
reads every step's outcome right after the step, as it did before the lag.

The overlapped optimizer update is not a hook: it is part of the step itself (an argument of
``precision.step``).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from mixprec.monitor.guard import StepOutcome
from mixprec.train.ending import stop_if_diverged

__all__ = ["StepHook", "around", "NumericsHook", "ReplanHook", "ScaleWatchHook", "ProfilerHook",
           "GuardHook"]


def around(trainer: Any, part: str, step: int) -> contextlib.ExitStack:
    """Every hook's ``part`` context (``around_step``/``_forward``/``_update``) of
    ``trainer.hooks``, in list order."""
    stack = contextlib.ExitStack()
    for hook in trainer.hooks:
        stack.enter_context(getattr(hook, part)(trainer, step))
    return stack


class StepHook:
    """One optional per-step helper (see the module docstring)."""

    needs_outcome_now = False
    """True: ``after_step`` must run before the next step's forward (the hook changes or samples
    what that forward sees), so ``fit()`` reads each step's outcome right after it."""

    def around_step(self, trainer: Any, step: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def around_forward(self, trainer: Any, step: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def around_update(self, trainer: Any, step: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def after_step(self, trainer: Any, step: int, out: Any, origin: str | None) -> None:
        return None

    def close(self) -> None:
        return None

    def describe(self) -> str | None:
        """A line for the run's start lines (what the hook watches), or None."""
        return None


class NumericsHook(StepHook):
    """Per-layer range statistics on sampled steps (:class:`mixprec.monitor.NumericsMonitor`)."""

    needs_outcome_now = True   # its rows are the sampled step's: the next forward samples anew

    def __init__(self, monitor: Any) -> None:
        self.monitor = monitor

    def around_forward(self, trainer, step):
        return self.monitor.sample(step)

    @contextlib.contextmanager
    def around_update(self, trainer, step) -> Iterator[None]:
        with self.monitor.track_updates(trainer.optimizer):
            yield
            if self.monitor.should_sample(step):
                trainer.settle()                  # the update statistics read the weights

    def after_step(self, trainer, step, out, origin):
        if self.monitor.should_sample(step):
            trainer.events.logger.log_numerics(self.monitor.last_rows)


class ReplanHook(StepHook):
    """Re-planning per-layer formats while training (:class:`mixprec.monitor.LayerReplanner`)."""

    needs_outcome_now = True   # it may switch a layer's format before the next forward

    def __init__(self, replanner: Any) -> None:
        self.replanner = replanner

    def around_forward(self, trainer, step):
        return self.replanner.sample(trainer.strategy.unwrap(trainer.model), step)

    def after_step(self, trainer, step, out, origin):
        # Layers whose inputs stopped fitting FP8 move up, healthy ones move back.
        for switch in self.replanner.decide(trainer.strategy.unwrap(trainer.model), step):
            trainer.events.format_switch(switch)


class ScaleWatchHook(StepHook):
    """A loss scale stuck at its floor (:class:`mixprec.monitor.ScaleWatch`): every stuck step is
    an ``events.jsonl`` record; the terminal gets the first one, saying so (it got one line per
    step, each after a raw Python warning: ``fit()`` keeps the watch's and the scaler's own
    warnings of it off the terminal)."""

    def __init__(self, watch: Any) -> None:
        self.watch = watch
        self.said = False

    def after_step(self, trainer, step, out, origin):
        warning = self.watch.observe(step, trainer.precision.scaler.get_scale(), out.skipped, origin)
        if warning:
            trainer.events.note(warning, step, "stuck-scale", say=False)
            if not self.said:
                self.said = True
                trainer.events.say(f"{warning} (further stuck steps: events.jsonl only)")


class ProfilerHook(StepHook):
    """``profile=STEPS``: a torch profile of a few steps (:class:`mixprec.monitor.profile.StepProfiler`)."""

    def __init__(self, profiler: Any) -> None:
        self.profiler = profiler

    def around_step(self, trainer, step):
        return self.profiler.step()

    def after_step(self, trainer, step, out, origin):
        if self.profiler.files:
            trainer.events.note(f"profile of {self.profiler.summary.steps} steps: "
                                f"{self.profiler.files[0]}, {self.profiler.files[1]}", step,
                                kind="profile")
            self.profiler.files = []

    def close(self) -> None:
        self.profiler.finish()                    # a run shorter than warm-up + steps


class GuardHook(StepHook):
    """Guarded training (:class:`mixprec.monitor.guard.TrainingGuard`): promote a layer that made
    inf/NaN or lost precision, restore the in-memory snapshot on a loss spike, stop when no safer
    format is left. Last in the list: a restore replaces weights the other hooks just measured.

    The one hook that needs more than ``after_step``'s arguments: the traced event's module
    (``trainer.step_event``) and a re-run of the step's forward for its probe
    (``trainer.replay_forward``, over ``trainer.step_batches``)."""

    needs_outcome_now = True   # it may restore weights or switch formats before the next forward

    def __init__(self, guard: Any) -> None:
        self.guard = guard

    def describe(self) -> str:
        return self.guard.describe()

    def around_step(self, trainer, step):
        self.guard.before_step(step)        # the first snapshot: weights before any step
        return contextlib.nullcontext()

    def after_step(self, trainer, step, out, origin):
        event = trainer.step_event
        outcome = StepOutcome(step, float(out.loss), out.skipped,           # host sync: the loss
                              event.module if event is not None else None,
                              event.direction if event is not None else None,
                              float(out.scale_before) if trainer.precision.recipe.scales_loss else None)
        for action in self.guard.after_step(outcome, probe=trainer.replay_forward):
            trainer.events.guard(action)
            if action.kind == "give-up":
                stop_if_diverged(trainer, action.message)   # exit 3, as a diverged run
