"""The loss scale's transition on the device: :func:`mixprec.amp.loss_scale.transition` as tensor
ops, for ``GradScaler.update()`` after an optimizer skipped on the device (no host read).

Two ways, the same numbers as the host's pure transition:

* **fused** (:func:`fused_transition`, where :func:`fused_exact` holds): torch's own one-kernel
  update ``torch._amp_update_scale_`` (a float32 scale and an int32 growth tracker), then one
  clamp to ``[min_scale, max_scale]`` and the reciprocal: 4 ops. Exact where the host's rule is
  torch's plus bounds, i.e. ``hysteresis == 1``, and no growth product can overflow float32:

  - the products: torch's kernel multiplies the float32 scale by the ``double`` factor and
    rounds to float32, as the host does (``_to_f32(scale * factor)``), for any factor;
  - the bounds, one clamp after the kernel: a backoff below ``min_scale`` (or from it: the
    host keeps a scale at the floor, torch's product then clamps back to it) gives ``min_scale``;
    a growth above ``max_scale`` gives ``max_scale``; the growth tracker is reset to 0 by both on
    every growth (also at ``max_scale``) and every overflow (also at ``min_scale``);
  - the tracker: torch grows when ``tracker + 1 == interval``, the host when ``>=``; the
    tracker is taken from the host's ``clean_steps`` clamped to ``interval - 1`` (a checkpoint or
    ``set_growth_interval`` can leave more): both then grow at the next clean step;
  - a product above float32's largest number: torch keeps the scale, the host's rounding raises;
    such settings (``max_scale * growth_factor`` beyond float32) take the general way.
  - 1/scale: float32's correctly rounded reciprocal equals the host's double ``1/scale``
    rounded to float32 (for a float32 ``scale`` the double quotient is never a float32 tie).

* **general** (:func:`transition`): hysteresis (and the rest) as ~33 elementwise ops on a
  float64 ``[scale, clean_steps, hysteresis_left]`` state.

The host state (counters, ``hysteresis_left``, ``state_dict()``) is never read from here: the
host replays the pure transition over the flags it reads lazily; the device only has to give
the scale each step multiplies the loss by, and its reciprocal.
"""
from __future__ import annotations

import torch
from torch import Tensor

from mixprec.amp.loss_scale import LossScaleConfig, _f32_bounds

__all__ = ["fused_exact", "initial_tracker", "fused_transition", "transition"]

_F32_MAX = float(torch.finfo(torch.float32).max)


def fused_exact(cfg: LossScaleConfig) -> bool:
    """Whether :func:`fused_transition` gives the host's numbers under ``cfg`` (module docstring)."""
    return cfg.hysteresis == 1 and _f32_bounds(cfg)[1] * cfg.scale_factor < _F32_MAX


def initial_tracker(clean_steps: int, cfg: LossScaleConfig, device: torch.device) -> Tensor:
    """The int32 growth tracker for the host's ``clean_steps`` (clamped below the interval)."""
    return torch.full((), min(clean_steps, cfg.scale_window - 1), dtype=torch.int32, device=device)


def fused_transition(scale: Tensor, tracker: Tensor, found_inf: Tensor, cfg: LossScaleConfig
                     ) -> tuple[Tensor, Tensor]:
    """The next float32 scale and 1/scale after one iteration whose (0-dim float32) flag is
    ``found_inf`` (> 0: overflow). ``scale`` (the current one, still the loss's factor for
    autograd) is not written: the new scale is a new tensor; ``tracker`` is updated in place."""
    lo, hi = _f32_bounds(cfg)
    new = scale.clone()
    torch._amp_update_scale_(new, tracker, found_inf, cfg.scale_factor, cfg.backoff_factor,
                             cfg.scale_window)
    new.clamp_(lo, hi)
    return new, new.reciprocal()


def transition(state: Tensor, overflow: Tensor, cfg: LossScaleConfig) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`mixprec.amp.loss_scale.transition` on the device, for ``state`` = float64
    ``[scale, clean_steps, hysteresis_left]`` and a 0-dim bool ``overflow``: the same numbers
    (products in float64 rounded to float32, clamped to the float32 bounds, as on the host).
    Returns the new state and the float32 scale and 1/scale for the next iteration."""
    lo, hi = _f32_bounds(cfg)
    scale, clean, hyst = state[0], state[1], state[2]
    left = hyst - 1
    backoff = overflow & (left <= 0)
    at_floor = scale <= lo
    down = torch.where(at_floor, scale, (scale * cfg.backoff_factor).float().clamp(lo, hi).double())
    clean1 = torch.where(overflow, torch.zeros_like(clean), clean + 1)
    grow = ~overflow & (clean1 >= cfg.scale_window)
    up = (scale * cfg.scale_factor).float().clamp(lo, hi).double()
    new_scale = torch.where(backoff, down, torch.where(grow, up, scale))
    new_clean = torch.where(grow, torch.zeros_like(clean1), clean1)
    new_hyst = torch.where(overflow, left.clamp(min=0),
                           torch.where(grow, torch.full_like(hyst, float(cfg.hysteresis)), hyst))
    new_state = torch.stack([new_scale, new_clean, new_hyst])
    return new_state, new_scale.float(), (1.0 / new_scale).float()
