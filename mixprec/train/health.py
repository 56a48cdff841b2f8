"""Is a run still training? The verdict that ends a diverged run with a clear message; and the
seeding of every random generator a run uses."""
from __future__ import annotations

import math

import torch

from mixprec.train.config import FitConfig

__all__ = ["RunHealth", "seed_everything"]


class RunHealth:
    """Is the run still training? It is not when the validation loss is non-finite, when
    ``_MAX_SKIP_RUN`` steps in a row were skipped (a non-finite loss is always a skipped step),
    or when more than ``max_skipped_fraction`` of the steps after warm-up were skipped. Skips before
    any step was taken (a loss scale calibrating down from its initial value) are not counted.
    An occasional skipped step (an FP16 overflow, then the scale backs off) is normal."""

    _MAX_SKIP_RUN = 20   # > the 16 back-offs that take a 2**16 loss scale down to 1

    def __init__(self, cfg: FitConfig, *, start_step: int) -> None:
        self.warmup = cfg.warmup_steps
        self.limit = cfg.max_skipped_fraction
        self.min_window = max(cfg.log_interval, 10)
        self.counted = self.skipped = self.run = 0
        self.taken_any = start_step > 0

    def add(self, step: int, skipped: bool) -> None:
        self.taken_any = self.taken_any or not skipped
        self.run = self.run + 1 if skipped else 0
        if step > self.warmup and self.taken_any:
            self.counted += 1
            self.skipped += int(skipped)

    def verdict(self, val_loss: float | None) -> str | None:
        if val_loss is not None and not math.isfinite(val_loss):
            return f"the validation loss is {val_loss}"
        if self.limit < 1.0 and self.run >= self._MAX_SKIP_RUN:
            return f"the last {self.run} steps were all skipped (non-finite loss or gradients)"
        if self.limit < 1.0 and self.counted >= self.min_window and self.skipped > self.limit * self.counted:
            return (f"{self.skipped} of the {self.counted} steps after warm-up were skipped for "
                    f"non-finite gradients (max_skipped_fraction={self.limit:g})")
        return None

    @staticmethod
    def still_backing_off(*, scales_loss: bool, scale: float, init_scale: float, min_scale: float,
                          loss_finite: bool) -> bool:
        """Skipped steps that are not divergence: the loss is finite and the loss scale is still
        halving its way down from a too-large ``init_scale`` (above its floor, below where it began)."""
        return scales_loss and loss_finite and min_scale < scale < init_scale

    @staticmethod
    def backing_off_message(*, init_scale: float, scale: float, skipped: int) -> str:
        return (f"the loss scale is still backing off from init_scale={init_scale:g} ({skipped} skipped "
                f"steps, now {scale:g}) while the loss is finite: this is not divergence; lower "
                f"init_scale (e.g. init_scale={min(max(scale, 1.0), 2.0 ** 16):g})")
    # The scale it reached is what to suggest, but never above 2^16 (torch's and mixprec's
    # default): from init_scale=1e30 the scale is still ~1e24 when the run is stopped, and
    # following "init_scale=9.5e+23" failed again (found by a new-user trial).


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA), numpy and ``random``."""
    import random

    import numpy as np
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
