"""torch LR schedulers and the optimizers mixprec puts under them.

torch's ``LRScheduler`` marks the ``step`` of the optimizer it is built on, to check that the
optimizer steps before the schedule; a schedule mixprec moves onto another optimizer (the FP32
masters that replaced the one it was built on), or an optimizer whose ``step`` mixprec replaces,
would warn "optimizer.step() has been overridden after learning rate scheduler initialization" at
its first step: about mixprec's own doing, not the user's. These two give the new step that mark.
"""
from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["move_scheduler", "replace_step"]


def move_scheduler(scheduler: Any, optimizer: Any) -> None:
    """Point ``scheduler`` at ``optimizer`` (the optimizer of the FP32 masters that replaced the one
    it was built on), as torch would have had it been built on that one: ``optimizer.step`` gets
    the scheduler's mark and sets the ``_opt_called`` flag it checks."""
    scheduler.optimizer = optimizer
    step = getattr(optimizer, "step", None)
    if step is None or hasattr(step, "_wrapped_by_lr_sched"):
        return
    opt_ref, func = weakref.ref(optimizer), getattr(step, "__func__", None)

    @functools.wraps(step)
    def marked(*args: Any, **kwargs: Any) -> Any:
        opt = opt_ref()
        opt._opt_called = True
        return func(opt, *args, **kwargs) if func is not None else step(*args, **kwargs)

    marked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = marked


def replace_step(optimizer: Any, step: Callable[..., Any]) -> None:
    """``optimizer.step = step``, marked as torch's ``LRScheduler`` marks the step it wraps, so a
    scheduler built on ``optimizer`` neither warns that its step was overridden nor that it
    stepped first."""

    @functools.wraps(step)
    def marked(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True
        return step(*args, **kwargs)

    marked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = marked
