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

    def scaler_cause(self, *, scales_loss: bool, scale: float, init_scale: float, min_scale: float,
                     growth_interval: int, hysteresis: int, loss_finite: bool, skipped: int) -> str | None:
        """When the skipped steps that stop a run come from the loss scaler's settings while the
        loss is finite (not divergence): the one that is the cause and its fix, one clause; None
        otherwise. In this order:

        * the scale is at a floor above 1 (``min_scale``): gradients scaled by it overflow and it
          may not go lower -- lower ``min_scale`` (it said "lower lr" for ``min_scale=1e10``);
        * a step was taken and ``growth_interval`` is so short that the overflows of each growth
          alone (``hysteresis`` skips per ``growth_interval`` clean steps) exceed
          ``max_skipped_fraction`` -- raise ``growth_interval`` (it said "still backing off from
          init_scale" of a scale that had grown back to 156250 with ``growth_interval=3``);
        * the scale is still halving its way down from a too-large ``init_scale``
          (:meth:`still_backing_off`) -- lower ``init_scale``.

        A floor of 1 is no setting to blame: gradients overflow unscaled, the run diverges."""
        if not (scales_loss and loss_finite):
            return None
        if scale <= min_scale * (1 + 1e-6) and min_scale > 1:     # (the scale is float32)
            return (f"the loss scale is stuck at its floor min_scale={min_scale:g} while the loss is "
                    f"finite ({skipped} skipped steps): gradients scaled by {min_scale:g} overflow and "
                    "the scale may not go lower; this is not divergence; lower min_scale (e.g. "
                    "min_scale=1, the default)")
        if self.taken_any and self.limit < 1.0 and hysteresis > self.limit * (growth_interval + hysteresis):
            return (f"the loss scale doubles after every growth_interval={growth_interval} clean steps "
                    f"and the doubled scale overflows (now {scale:g}, {skipped} skipped steps) while "
                    f"the loss is finite: that setting alone skips up to {hysteresis} step"
                    f"{'s' if hysteresis != 1 else ''} in {growth_interval + hysteresis}; this is not "
                    "divergence; raise growth_interval (e.g. growth_interval=2000, the default)")
        if self.still_backing_off(scales_loss=scales_loss, scale=scale, init_scale=init_scale,
                                  min_scale=min_scale, loss_finite=loss_finite):
            return self.backing_off_message(init_scale=init_scale, scale=scale, skipped=skipped)
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
