"""Learning-rate schedule: linear warm-up, then cosine decay to a floor.

A callable object (not a lambda) so that ``LambdaLR.state_dict()`` stores its settings as plain
data and a checkpoint loads with ``weights_only=True``.
"""
from __future__ import annotations

import math

import torch

__all__ = ["WarmupCosine", "warmup_cosine_scheduler"]


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
