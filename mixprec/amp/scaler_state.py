""":class:`mixprec.amp.GradScaler`'s state as plain values: its checkpoint (torch's five keys plus
mixprec's extras, safe for ``torch.load(weights_only=True)``), read back, and a scale set by hand
(``update(new_scale)``)."""
from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from mixprec.amp.loss_scale import LossScaleConfig, LossScaleState, _to_f32
from mixprec.errors import ConfigError

__all__ = ["state_dict", "settings", "loaded_state", "checked_scale"]

# torch's state-dict key (or mixprec's extra) -> the LossScaleConfig field it sets
_NAMES = {"growth_factor": "scale_factor", "backoff_factor": "backoff_factor",
          "growth_interval": "scale_window", "hysteresis": "hysteresis",
          "min_scale": "min_scale", "max_scale": "max_scale", "on_min_scale": "on_min_scale"}


def state_dict(cfg: LossScaleConfig, st: LossScaleState, counters: dict[str, int]) -> dict[str, Any]:
    """The checkpoint of a scaler with scaling on (torch's keys first)."""
    return {"scale": st.scale, "growth_factor": cfg.scale_factor,
            "backoff_factor": cfg.backoff_factor, "growth_interval": cfg.scale_window,
            "_growth_tracker": st.clean_steps, "hysteresis": cfg.hysteresis,
            "_hysteresis_left": st.hysteresis_left, "min_scale": cfg.min_scale,
            "max_scale": cfg.max_scale, "on_min_scale": cfg.on_min_scale,
            "_scale_overflows": st.num_overflows, **counters}


def settings(sd: dict[str, Any], cfg: LossScaleConfig) -> dict[str, Any]:
    """The config changes ``sd`` holds, as ``LossScaleConfig`` fields; ``init_scale`` moved into
    the loaded bounds (it only has to be valid under them: the loaded scale is checked itself)."""
    lo, hi = sd.get("min_scale", cfg.min_scale), sd.get("max_scale", cfg.max_scale)
    changes = {ours: sd[theirs] for theirs, ours in _NAMES.items() if theirs in sd}
    return {**changes, "init_scale": min(max(cfg.init_scale, lo), hi)}


def loaded_state(sd: dict[str, Any], cfg: LossScaleConfig) -> LossScaleState:
    """The scale state ``sd`` holds (missing extras as a torch scaler's would be: fresh)."""
    return LossScaleState(scale=_to_f32(float(sd["scale"])),
                          clean_steps=int(sd.get("_growth_tracker", 0)),
                          hysteresis_left=int(sd.get("_hysteresis_left", cfg.hysteresis)),
                          num_overflows=int(sd.get("_scale_overflows", 0)))


def checked_scale(new_scale: float | Tensor, cfg: LossScaleConfig) -> float:
    """``update(new_scale)``'s argument as a float32 value in ``[min_scale, max_scale]``."""
    if isinstance(new_scale, Tensor):
        if new_scale.numel() != 1 or new_scale.requires_grad:
            raise ConfigError("update(new_scale) takes a float or a 1-element tensor without "
                              "requires_grad")
        new_scale = float(new_scale.item())
    if isinstance(new_scale, bool) or not isinstance(new_scale, (int, float)):
        raise ConfigError(f"update(new_scale) takes a float, not {type(new_scale).__name__}")
    if not (math.isfinite(new_scale) and cfg.min_scale <= new_scale <= cfg.max_scale):
        raise ConfigError(f"new scale {new_scale} must be finite and in [min_scale, max_scale] "
                          f"= [{cfg.min_scale}, {cfg.max_scale}]")
    return _to_f32(float(new_scale))
