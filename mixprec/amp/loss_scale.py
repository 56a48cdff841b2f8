"""Dynamic loss scaling as a small, pure state machine.

FP16 has 5 exponent bits: gradients below ~6e-8 flush to zero. Multiplying the loss by a large
*scale* before ``backward()`` shifts every gradient up into the representable range; dividing by
the same scale before the optimizer step undoes it. The right scale is the largest one that does
not overflow, and it drifts during training, so it is found dynamically:

    on every step:
        if the gradients hold an inf or NaN (an *overflow*):
            the optimizer step is skipped (the caller's job), the clean-step counter resets,
            and one unit of hysteresis is spent;
            when no hysteresis is left: scale <- max(scale * backoff_factor, min_scale)
            if the scale was already at min_scale: the scale is *stuck* (raise or warn)
        else:
            clean_steps += 1
            when clean_steps == scale_window:
                scale <- min(scale * scale_factor, max_scale); clean_steps <- 0;
                hysteresis is refilled

Hysteresis choice (documented, tested): the budget of tolerated overflows is refilled only when
the scale *grows*, not on every clean step. Isolated overflows spread over one growth window are
therefore tolerated at most ``hysteresis - 1`` times, and once the budget is spent every further
overflow backs off until the next growth. (DeepSpeed calls the other choice ``consecutive_hysteresis``;
Megatron-LM does what we do.) With ``hysteresis=1`` every overflow backs off at once, which is the
algorithm of ``torch.amp.GradScaler``; the trajectories are tested to be identical.

The source article on loss scaling (docs/sources.md) writes this class upside down: it grows the
scale on every clean step and shrinks it only after ``scale_window`` consecutive overflows, so it
overflows every other step. We keep its names — ``init_scale``, ``scale_factor``,
``scale_window``, ``update_scale(has_overflow)`` — with the standard algorithm above.

The scale is always a normal, finite float32 value in ``[min_scale, max_scale]``: the bounds are
validated so that neither the scale nor its reciprocal can be 0, subnormal or inf in float32.
"""
from __future__ import annotations

import dataclasses
import math
import struct
import warnings
from dataclasses import dataclass
from typing import Any, Literal

from mixprec.errors import CheckpointError, ConfigError, NumericsError

__all__ = ["LossScaleConfig", "LossScaleState", "Transition", "transition", "DynamicLossScaler",
           "StuckLossScaleWarning"]


class StuckLossScaleWarning(RuntimeWarning):
    """A backoff was due at ``min_scale`` with ``on_min_scale="warn"`` (one per such step).
    ``fit()`` keeps it off the terminal: its stuck-scale watch reports the same, once, with the
    cause (:class:`mixprec.monitor.ScaleWatch`)."""

# Bounds that keep both the scale and 1/scale normal and finite in float32.
_F32_TINY = 2.0 ** -126
_F32_SAFE_MAX = 2.0 ** 126
_ON_MIN = ("raise", "warn")


def _to_f32(x: float) -> float:
    """Round a Python float to the nearest float32 (the precision the scale is applied in)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _check_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, not {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be finite, not {value}")
    return value


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, not {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    """Settings of the dynamic loss scale. Validated at construction."""

    init_scale: float = 2.0 ** 16
    """Scale of the first step. Must lie in ``[min_scale, max_scale]``."""
    scale_factor: float = 2.0
    """Growth factor applied after ``scale_window`` clean steps; must be > 1."""
    scale_window: int = 2000
    """Consecutive clean (finite-gradient) steps needed before the scale grows."""
    backoff_factor: float = 0.5
    """Factor applied when an overflow backs the scale off; must lie in (0, 1)."""
    hysteresis: int = 1
    """Overflows tolerated before backing off (1 = back off at every overflow). Refilled on growth."""
    min_scale: float = 1.0
    """Floor of the scale. A backoff due while already at the floor means the scale is stuck."""
    max_scale: float = 2.0 ** 24
    """Ceiling of the scale; growth stops here instead of running to inf."""
    on_min_scale: Literal["raise", "warn"] = "raise"
    """What a stuck scale does: ``"raise"`` a NumericsError, or ``"warn"`` and keep skipping."""

    def __post_init__(self) -> None:
        for name in ("init_scale", "scale_factor", "backoff_factor", "min_scale", "max_scale"):
            object.__setattr__(self, name, _check_number(name, getattr(self, name)))
        _check_count("scale_window", self.scale_window)
        _check_count("hysteresis", self.hysteresis)
        if self.scale_factor <= 1.0:
            raise ConfigError(f"scale_factor (growth factor) must be > 1, not {self.scale_factor}; "
                              "the scale grows by it after scale_window clean steps (try 2.0)")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ConfigError(f"backoff_factor must lie strictly between 0 and 1, not "
                              f"{self.backoff_factor}; the scale shrinks by it on overflow (try 0.5)")
        if not _F32_TINY <= self.min_scale <= _F32_SAFE_MAX:
            raise ConfigError(f"min_scale must lie in [2**-126, 2**126] so that the scale and its "
                              f"reciprocal stay normal float32 numbers, not {self.min_scale}")
        if not _F32_TINY <= self.max_scale <= _F32_SAFE_MAX:
            raise ConfigError(f"max_scale must lie in [2**-126, 2**126] so that the scale and its "
                              f"reciprocal stay normal float32 numbers, not {self.max_scale}")
        if self.min_scale > self.max_scale:
            raise ConfigError(f"min_scale ({self.min_scale}) is above max_scale ({self.max_scale}); "
                              "swap them or widen the range")
        if not self.min_scale <= self.init_scale <= self.max_scale:
            raise ConfigError(f"init_scale ({self.init_scale}) must lie in [min_scale, max_scale] = "
                              f"[{self.min_scale}, {self.max_scale}]; change init_scale or the bounds")
        if self.on_min_scale not in _ON_MIN:
            raise ConfigError(f"on_min_scale must be 'raise' or 'warn', not {self.on_min_scale!r}")

    def initial_state(self) -> LossScaleState:
        return LossScaleState(scale=_clamp_f32(self.init_scale, self), clean_steps=0,
                              hysteresis_left=self.hysteresis)


def _f32_bounds(cfg: LossScaleConfig) -> tuple[float, float]:
    """The bounds rounded *inward* to float32: smallest f32 >= min_scale, largest f32 <= max_scale."""
    lo, hi = _to_f32(cfg.min_scale), _to_f32(cfg.max_scale)
    if lo < cfg.min_scale:
        lo = _f32_step(lo, +1)
    if hi > cfg.max_scale:
        hi = _f32_step(hi, -1)
    return lo, hi


def _f32_step(x: float, ulps: int) -> float:
    """The float32 ``ulps`` steps away from the (positive, float32) ``x``."""
    (bits,) = struct.unpack("I", struct.pack("f", x))
    return struct.unpack("f", struct.pack("I", bits + ulps))[0]


def _clamp_f32(x: float, cfg: LossScaleConfig) -> float:
    """Round to float32 and keep inside the (inward-rounded) bounds."""
    lo, hi = _f32_bounds(cfg)
    return min(max(_to_f32(x), lo), hi)


@dataclass(frozen=True, kw_only=True)
class LossScaleState:
    """Where the scaler stands between steps (everything a checkpoint needs)."""

    scale: float
    """Current loss scale (a float32 value)."""
    clean_steps: int = 0
    """Consecutive clean steps since the last growth or overflow."""
    hysteresis_left: int = 1
    """Overflows that may still happen before the next one backs the scale off."""
    num_overflows: int = 0
    """Overflow steps seen in total."""


@dataclass(frozen=True)
class Transition:
    """The result of one :func:`transition`: the next state and what happened."""

    state: LossScaleState
    grew: bool = False
    backed_off: bool = False
    stuck: bool = False
    """A backoff was due while the scale was already at ``min_scale``."""


def transition(state: LossScaleState, config: LossScaleConfig, overflow: bool) -> Transition:
    """The next state after one step. Pure: no side effects, no errors (see module docstring)."""
    if overflow:
        left = state.hysteresis_left - 1
        counted = dataclasses.replace(state, clean_steps=0, num_overflows=state.num_overflows + 1)
        if left > 0:
            return Transition(dataclasses.replace(counted, hysteresis_left=left))
        at_floor = state.scale <= _f32_bounds(config)[0]
        new_scale = state.scale if at_floor else _clamp_f32(state.scale * config.backoff_factor, config)
        # The budget stays spent (0): every further overflow backs off until the scale grows.
        return Transition(dataclasses.replace(counted, scale=new_scale, hysteresis_left=0),
                          backed_off=not at_floor, stuck=at_floor)
    clean = state.clean_steps + 1
    if clean < config.scale_window:
        return Transition(dataclasses.replace(state, clean_steps=clean))
    new_scale = _clamp_f32(state.scale * config.scale_factor, config)
    return Transition(dataclasses.replace(state, scale=new_scale, clean_steps=0,
                                          hysteresis_left=config.hysteresis),
                      grew=new_scale > state.scale)


class DynamicLossScaler:
    """The source article's class (docs/sources.md), fixed: ``scaler.scale`` is the current
    scale; call ``update_scale(has_overflow)`` once per step (skipping the optimizer step yourself
    on overflow).

    >>> s = DynamicLossScaler(init_scale=4, scale_window=2)
    >>> _ = s.update_scale(False); _ = s.update_scale(False); s.scale
    8.0
    """

    def __init__(self, init_scale: float = 2.0 ** 16, scale_factor: float = 2.0,
                 scale_window: int = 2000, *, backoff_factor: float = 0.5, hysteresis: int = 1,
                 min_scale: float = 1.0, max_scale: float = 2.0 ** 24,
                 on_min_scale: Literal["raise", "warn"] = "raise") -> None:
        self.config = LossScaleConfig(init_scale=init_scale, scale_factor=scale_factor,
                                      scale_window=scale_window, backoff_factor=backoff_factor,
                                      hysteresis=hysteresis, min_scale=min_scale,
                                      max_scale=max_scale, on_min_scale=on_min_scale)
        self.state = self.config.initial_state()

    @property
    def scale(self) -> float:
        return self.state.scale

    @property
    def num_overflows(self) -> int:
        return self.state.num_overflows

    def update_scale(self, has_overflow: bool) -> Transition:
        """Advance one step. On a stuck scale, raises NumericsError or warns (``on_min_scale``)."""
        t = transition(self.state, self.config, bool(has_overflow))
        self.state = t.state
        if t.stuck:
            msg = (f"loss scale is stuck at min_scale={self.config.min_scale:g}: gradients are "
                   f"non-finite even at the smallest allowed scale ({t.state.num_overflows} "
                   "overflows so far); find the layer that produces them with "
                   "mixprec.monitor.locate_nonfinite"
                   + (", or lower min_scale" if self.config.min_scale > _F32_TINY else ""))
            if self.config.on_min_scale == "raise":
                raise NumericsError(msg)
            warnings.warn(msg, StuckLossScaleWarning, stacklevel=2)
        return t

    # --- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self.state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        try:
            state = LossScaleState(**state_dict)
        except TypeError as e:
            raise CheckpointError(f"not a DynamicLossScaler state dict ({e}); expected keys "
                                  f"{[f.name for f in dataclasses.fields(LossScaleState)]}") from None
        if not self.config.min_scale <= state.scale <= self.config.max_scale:
            raise CheckpointError(f"checkpointed loss scale {state.scale} lies outside [min_scale, "
                                  f"max_scale] = [{self.config.min_scale}, {self.config.max_scale}]; "
                                  "widen the bounds to load it")
        self.state = state

    def __repr__(self) -> str:
        c, s = self.config, self.state
        return (f"DynamicLossScaler(scale={s.scale:g}, clean_steps={s.clean_steps}/{c.scale_window}, "
                f"hysteresis_left={s.hysteresis_left}/{c.hysteresis}, overflows={s.num_overflows})")
