"""Learning-rate schedule: linear warm-up, then cosine decay to a floor.

A callable object (not a lambda) so that ``LambdaLR.state_dict()`` stores its settings as plain
data and a checkpoint loads with ``weights_only=True``.
"""
from __future__ import annotations

import math

import torch

__all__ = ["WarmupCosine", "warmup_cosine_scheduler", "restretch", "rewind"]


class WarmupCosine:
    """Multiplier of the peak LR at optimizer step ``s`` (0-based count of steps *taken*)."""

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> None:
        self.warmup_steps = int(warmup_steps)
        self.total_steps = max(int(total_steps), 1)
        self.min_ratio = float(min_ratio)

    def __call__(self, s: int) -> float:
        if s < self.warmup_steps:
            return (s + 1) / self.warmup_steps
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min((s - self.warmup_steps) / span, 1.0)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                            min_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(warmup_steps, total_steps, min_ratio))


def restretch(scheduler: torch.optim.lr_scheduler.LambdaLR, *, base_lrs: list[float],
              warmup_steps: int, total_steps: int, min_ratio: float) -> list[float]:
    """Give a (restored) warm-up + cosine scheduler new settings, in place, keeping its count of
    steps taken: each group's peak LR (and ``initial_lr``) becomes ``base_lrs[i]``, the curve
    becomes ``WarmupCosine(warmup_steps, total_steps, min_ratio)``, and every group's current LR is
    the new curve's value at the steps taken. Returns those LRs. The same settings change nothing
    (the LR is computed as ``LambdaLR`` computes it)."""
    curve = WarmupCosine(warmup_steps, total_steps, min_ratio)
    state = scheduler.state_dict()
    groups = scheduler.optimizer.param_groups
    if len(base_lrs) != len(groups):
        raise ValueError(f"{len(base_lrs)} peak LRs for {len(groups)} parameter groups")
    state["base_lrs"] = [float(lr) for lr in base_lrs]
    state["lr_lambdas"] = [dict(vars(curve)) for _ in groups]
    lrs = [base * curve(state["last_epoch"]) for base in state["base_lrs"]]
    state["_last_lr"] = lrs
    scheduler.load_state_dict(state)
    for group, base, value in zip(groups, state["base_lrs"], lrs):
        group["initial_lr"] = base
        group["lr"] = value
    return lrs


def rewind(scheduler, saved: dict) -> list[float]:
    """Set ``scheduler`` back to the count of steps taken in ``saved`` (a ``state_dict()`` it gave
    earlier), keeping its current settings: a ``LambdaLR`` (mixprec's warm-up + cosine among them)
    keeps its current curve and peak LRs, which a resume may have changed since (``restretch``),
    and computes the LR of that step on them; any other scheduler loads ``saved`` whole. Every
    parameter group's ``lr`` is set to the result, which is returned."""
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        state = scheduler.state_dict()
        state["last_epoch"] = saved["last_epoch"]
        if "_step_count" in saved:
            state["_step_count"] = saved["_step_count"]
        lrs = [base * fn(state["last_epoch"])
               for fn, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)]
        state["_last_lr"] = lrs
        scheduler.load_state_dict(state)            # (its own curve: nothing changes but the count)
    else:
        scheduler.load_state_dict(saved)
        lrs = list(scheduler.get_last_lr())
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    return lrs
