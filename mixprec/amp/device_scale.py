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
the scale each step multiplies the loss by, and its reciprocal. :class:`ScaleTensors` keeps
those tensors for ``GradScaler``: built from the host's scale, or moved here ahead of it.
"""
from __future__ import annotations

import torch
from torch import Tensor

from mixprec.amp.loss_scale import LossScaleConfig, LossScaleState, _f32_bounds, _to_f32

__all__ = ["fused_exact", "initial_tracker", "fused_transition", "transition", "ScaleTensors"]

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


class ScaleTensors:
    """The scale and 1/scale as 0-dim float32 tensors per device. While the host's scale leads,
    they are built from it (cached per value); once an update moved the scale on the device
    (:meth:`advance`), the moved tensors lead until :meth:`drop` (the host caught up, or set it)."""

    def __init__(self) -> None:
        self._cached_for: float | None = None         # host scale the cached tensors were built for
        self._scale_t: dict[torch.device, Tensor] = {}
        self._inv_scale_t: dict[torch.device, Tensor] = {}
        self.state: Tensor | None = None      # the general way: float64 [scale, clean, hyst]
        self.tracker: Tensor | None = None    # the fused way: torch's int32 growth tracker
        self.scale: Tensor | None = None      # float32 scale and 1/scale, moved on the device
        self.inv: Tensor | None = None

    def drop(self) -> None:
        """The host state moved (or was set): the device copy is rebuilt from it when needed."""
        self.state = self.tracker = self.scale = self.inv = None

    def for_device(self, device: torch.device, host_scale: float) -> tuple[Tensor, Tensor]:
        if self.scale is not None:     # the device state leads (or equals) the host's
            if self.scale.device != device:
                return self.scale.to(device), self.inv.to(device)
            return self.scale, self.inv
        if self._cached_for != host_scale:
            self._scale_t.clear()
            self._inv_scale_t.clear()
            self._cached_for = host_scale
        t = self._scale_t.get(device)
        if t is None:
            t = self._scale_t[device] = torch.full((), host_scale, dtype=torch.float32, device=device)
            # 1/s computed in double, then rounded to float32 (as torch does).
            self._inv_scale_t[device] = torch.full((), _to_f32(1.0 / host_scale),
                                                   dtype=torch.float32, device=device)
        return t, self._inv_scale_t[device]

    def advance(self, flags: list[Tensor], known_bad: bool, host: LossScaleState,
                cfg: LossScaleConfig) -> None:
        """One iteration's transition on the device, over its ``flags`` (and ``known_bad``: a flag
        the host read already was non-finite); ``host`` is the host's state, the start when the
        device holds none yet."""
        dev = flags[0].device
        found = flags[0] if len(flags) == 1 else torch.stack([f.to(dev) for f in flags]).amax()
        if fused_exact(cfg):       # torch's one-kernel update + one clamp
            if self.tracker is None:
                self.tracker = initial_tracker(host.clean_steps, cfg, dev)
            if known_bad:
                found = torch.ones_like(found)
            scale = self.for_device(dev, host.scale)[0]
            self.scale, self.inv = fused_transition(scale, self.tracker, found, cfg)
        else:                      # hysteresis: the general transition
            if self.state is None:
                self.state = torch.tensor([host.scale, float(host.clean_steps),
                                           float(host.hysteresis_left)], dtype=torch.float64,
                                          device=dev)
            overflow = (found > 0) | known_bad
            self.state, self.scale, self.inv = transition(self.state, overflow, cfg)
