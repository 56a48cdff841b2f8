"""Notice when dynamic loss scaling has stopped working, and say which layers are to blame.

A loss scaler that keeps backing off is a symptom, not a diagnosis: some layer overflows on most
steps and the scaler can only shrink gradients until they underflow instead. :class:`ScaleWatch`
watches the scale and the skipped steps and, when the scale sits at its minimum while steps are
still skipped, or when more than ``max_skip_fraction`` of the last ``window`` steps were skipped,
warns (or raises :class:`~mixprec.errors.NumericsError`) naming the modules most often found at
the origin of the non-finite values (from :func:`mixprec.monitor.locate_nonfinite` events).
"""
from __future__ import annotations

import warnings
from collections import Counter, deque

from mixprec.errors import ConfigError, NumericsError

__all__ = ["ScaleWatch", "StuckScaleWarning"]


class StuckScaleWarning(RuntimeWarning):
    """Issued by :class:`ScaleWatch` with ``on_stuck="warn"``."""


class ScaleWatch:
    """Detect a stuck loss scale.

    ``observe(step, scale, skipped, origin)`` after every optimizer step (``origin`` is the module
    name of that step's :class:`~mixprec.monitor.NonFiniteEvent`, or None). It returns None while
    all is well, otherwise the message, which it also issues as a :class:`StuckScaleWarning`
    (``on_stuck="warn"``, at most once per ``window`` steps so logs stay readable) or raises as
    :class:`~mixprec.errors.NumericsError` (``on_stuck="raise"``).

    The skip-fraction rule needs a full window, so the first backoffs while a fresh scaler finds
    its level (65536 -> a few halvings) do not count as stuck.
    """

    def __init__(self, min_scale: float, *, window: int = 100, max_skip_fraction: float = 0.2,
                 on_stuck: str = "warn") -> None:
        if not min_scale > 0:
            raise ConfigError(f"ScaleWatch min_scale={min_scale} must be > 0 (the scaler's minimum loss scale)")
        if not isinstance(window, int) or window < 1:
            raise ConfigError(f"ScaleWatch window={window!r} must be a positive number of steps")
        if not 0 <= max_skip_fraction < 1:
            raise ConfigError(f"ScaleWatch max_skip_fraction={max_skip_fraction} must be in [0, 1)")
        if on_stuck not in ("warn", "raise"):
            raise ConfigError(f"ScaleWatch on_stuck='{on_stuck}' must be 'warn' or 'raise'")
        self.min_scale = float(min_scale)
        self.window = window
        self.max_skip_fraction = float(max_skip_fraction)
        self.on_stuck = on_stuck
        self._skips: deque[bool] = deque(maxlen=window)
        self._origins: deque[str | None] = deque(maxlen=window)
        self._last_warned: int | None = None

    def observe(self, step: int, scale: float, skipped: bool, origin: str | None = None) -> str | None:
        """Record one step; return (and warn/raise) a message when the scale is stuck."""
        self._skips.append(bool(skipped))
        self._origins.append(origin if skipped else None)
        n_skip = sum(self._skips)
        reasons = []
        at_floor = skipped and scale <= self.min_scale * (1 + 1e-6)     # (the scale is float32)
        if at_floor:
            reasons.append(f"loss scale {scale:g} is at its minimum {self.min_scale:g} and the step "
                           "was still skipped")
        if len(self._skips) == self.window and n_skip > self.max_skip_fraction * self.window:
            reasons.append(f"{n_skip} of the last {self.window} steps were skipped "
                           f"(limit {self.max_skip_fraction:.0%})")
        if not reasons:
            return None
        msg = f"step {step}: loss scale stuck: {'; '.join(reasons)}; {self._blame(at_floor)}"
        if self.on_stuck == "raise":
            raise NumericsError(msg)
        if self._last_warned is None or step - self._last_warned >= self.window:
            self._last_warned = step
            warnings.warn(msg, StuckScaleWarning, stacklevel=2)
        return msg

    def most_common_origins(self, n: int = 3) -> list[tuple[str, int]]:
        """The modules most often at the origin of a skipped step in the window."""
        return Counter(o for o in self._origins if o is not None).most_common(n)

    def _blame(self, at_floor: bool = False) -> str:
        """The cause and its fix. At a floor above 1 that is the floor: gradients scaled by it
        overflow whatever a layer does, and the layer a trace finds first is only where the
        overflow shows (``min_scale=1e10`` was blamed on the head, with layer fixes)."""
        if at_floor and self.min_scale > 1:
            return (f"the floor is the cause: gradients scaled by {self.min_scale:g} overflow and the "
                    "scale may not go lower; fix: lower min_scale (e.g. min_scale=1, the default)")
        top = self.most_common_origins()
        fix = ("fix: keep these layers in fp32 (keep_in_fp32 / Policy.keep_fp32_names), clamp their "
               "activations (mixprec.nn.clamp_activations), lower the learning rate, or train in bf16")
        if not top:
            return ("no origin recorded (trace skipped steps with mixprec.monitor.locate_nonfinite); " + fix)
        where = ", ".join(f"{name} ({count}x)" for name, count in top)
        return f"non-finite values start most often at {where}; {fix}"

    def state_dict(self) -> dict:
        """For checkpoints: the window's history, so a resumed run judges the same steps."""
        return {"skips": list(self._skips), "origins": list(self._origins), "last_warned": self._last_warned}

    def load_state_dict(self, state: dict) -> None:
        self._skips = deque(state["skips"], maxlen=self.window)
        self._origins = deque(state["origins"], maxlen=self.window)
        self._last_warned = state["last_warned"]
