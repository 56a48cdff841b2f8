"""DynamicLossScaler: exact trajectories, a reference-model fuzz, bounds and config validation."""
from __future__ import annotations

import math
import random
import warnings

import numpy as np
import pytest

from mixprec.amp import DynamicLossScaler, LossScaleConfig, LossScaleState, transition
from mixprec.errors import CheckpointError, ConfigError, NumericsError

F32_TINY = float(np.finfo(np.float32).tiny)


# --- exact trajectories ---------------------------------------------------------------------------

def test_grows_after_scale_window_clean_steps_and_backs_off_at_once():
    s = DynamicLossScaler(init_scale=4, scale_factor=2, scale_window=2)
    s.update_scale(False)
    assert s.scale == 4.0          # one clean step: not yet
    s.update_scale(False)
    assert s.scale == 8.0          # two clean steps: grown
    s.update_scale(True)
    assert s.scale == 4.0          # overflow: backed off at once (backoff 0.5)
    s.update_scale(False)
    assert s.scale == 4.0          # the clean-step counter restarted at the overflow
    s.update_scale(False)
    assert s.scale == 8.0


def test_seed_000_inversion_is_fixed():
    # Seed 000 grew on every clean step and shrank only after scale_window overflows in a row.
    s = DynamicLossScaler(init_scale=2 ** 15, scale_factor=2, scale_window=2000)
    for _ in range(10):
        s.update_scale(False)
    assert s.scale == 2 ** 15
    s.update_scale(True)
    assert s.scale == 2 ** 14


def test_hysteresis_tolerates_overflows_until_spent_then_backs_off_each_time():
    s = DynamicLossScaler(init_scale=64, scale_window=3, hysteresis=3)
    s.update_scale(True)
    s.update_scale(True)
    assert s.scale == 64                       # two overflows tolerated
    s.update_scale(True)
    assert s.scale == 32                       # third one backs off
    s.update_scale(True)
    assert s.scale == 16                       # budget stays spent
    assert s.num_overflows == 4


def test_hysteresis_is_refilled_by_growth_not_by_clean_steps():
    s = DynamicLossScaler(init_scale=64, scale_window=3, hysteresis=2)
    s.update_scale(True)                       # budget 2 -> 1, no backoff
    s.update_scale(False)
    s.update_scale(False)                      # clean steps do not refill...
    s.update_scale(True)
    assert s.scale == 32                       # ...so this overflow backs off
    for _ in range(3):
        s.update_scale(False)                  # growth refills
    assert s.scale == 64 and s.state.hysteresis_left == 2
    s.update_scale(True)
    assert s.scale == 64


# --- bounds ---------------------------------------------------------------------------------------

def test_growth_stops_at_max_scale_instead_of_inf():
    s = DynamicLossScaler(init_scale=2.0 ** 120, scale_window=1, max_scale=2.0 ** 126)
    for _ in range(50):
        s.update_scale(False)
    assert s.scale == 2.0 ** 126 and math.isfinite(1.0 / s.scale)


def test_floor_is_respected_and_stuck_policy_raises():
    s = DynamicLossScaler(init_scale=4, min_scale=1, on_min_scale="raise")
    s.update_scale(True)
    s.update_scale(True)
    assert s.scale == 1.0
    with pytest.raises(NumericsError, match="stuck at min_scale=1"):
        s.update_scale(True)
    assert s.scale == 1.0


def test_stuck_policy_warn_keeps_going_at_the_floor():
    s = DynamicLossScaler(init_scale=2, min_scale=1, on_min_scale="warn")
    s.update_scale(True)
    from mixprec.amp import StuckLossScaleWarning     # its own class: fit() can keep it off the terminal
    with pytest.warns(StuckLossScaleWarning, match="stuck at min_scale"):
        s.update_scale(True)
    assert s.scale == 1.0
    s.update_scale(False)
    assert s.scale == 1.0


def test_backoff_never_reaches_zero_or_subnormal():
    s = DynamicLossScaler(init_scale=1.0, backoff_factor=1e-3, min_scale=F32_TINY, on_min_scale="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(100):
            s.update_scale(True)
            assert s.scale >= F32_TINY and np.float32(s.scale) == s.scale


def test_non_float32_bounds_round_inward():
    s = DynamicLossScaler(init_scale=0.2, min_scale=0.1, max_scale=0.3, scale_window=1,
                          on_min_scale="warn")
    for _ in range(5):
        s.update_scale(False)
    assert s.scale <= 0.3 and np.float32(s.scale) == s.scale
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(5):
            s.update_scale(True)
    assert s.scale >= 0.1 and np.float32(s.scale) == s.scale


# --- reference-model fuzz -------------------------------------------------------------------------

class ReferenceScaler:
    """An independent, imperative restatement of the documented algorithm (numpy float32)."""

    def __init__(self, init, growth, backoff, window, hysteresis, lo, hi):
        f32 = np.float32
        # (compare as Python floats: numpy would compare a float32 with a float in float32)
        self.lo = f32(lo) if float(f32(lo)) >= lo else np.nextafter(f32(lo), f32(np.inf))
        self.hi = f32(hi) if float(f32(hi)) <= hi else np.nextafter(f32(hi), f32(0))
        self.scale = min(max(f32(init), self.lo), self.hi)
        self.growth, self.backoff, self.window, self.hyst = growth, backoff, window, hysteresis
        self.good = 0
        self.budget = hysteresis
        self.overflows = 0

    def step(self, overflow: bool) -> bool:
        """Returns True when the scale is stuck."""
        if not overflow:
            self.good += 1
            if self.good == self.window:
                self.good = 0
                self.budget = self.hyst
                self.scale = min(np.float32(float(self.scale) * self.growth), self.hi)
            return False
        self.overflows += 1
        self.good = 0
        self.budget -= 1
        if self.budget > 0:
            return False
        self.budget = 0
        if self.scale <= self.lo:
            return True
        self.scale = max(np.float32(float(self.scale) * self.backoff), self.lo)
        return False


def _random_config(rng: random.Random) -> LossScaleConfig:
    lo = 2.0 ** rng.uniform(-20, 4) * rng.choice([1.0, rng.uniform(1, 2)])
    hi = lo * 2.0 ** rng.uniform(0, 40)
    init = math.exp(rng.uniform(math.log(lo), math.log(hi)))
    return LossScaleConfig(init_scale=init, scale_factor=rng.choice([2.0, rng.uniform(1.01, 8)]),
                           scale_window=rng.randint(1, 6), hysteresis=rng.randint(1, 4),
                           backoff_factor=rng.choice([0.5, rng.uniform(0.01, 0.99)]),
                           min_scale=lo, max_scale=hi, on_min_scale="warn")


@pytest.mark.parametrize("seed", range(6))
def test_transition_matches_reference_model_on_random_sequences_and_configs(seed):
    rng = random.Random(seed)
    for _ in range(60):                                       # 60 configs x 150 steps per seed
        cfg = _random_config(rng)
        ref = ReferenceScaler(cfg.init_scale, cfg.scale_factor, cfg.backoff_factor,
                              cfg.scale_window, cfg.hysteresis, cfg.min_scale, cfg.max_scale)
        state = cfg.initial_state()
        p_overflow = rng.choice([0.02, 0.2, 0.5, 0.9])
        for i in range(150):
            overflow = rng.random() < p_overflow
            t = transition(state, cfg, overflow)
            ref_stuck = ref.step(overflow)
            state = t.state
            where = f"config {cfg}, step {i}"
            assert state.scale == float(ref.scale), where
            assert (state.clean_steps, state.num_overflows) == (ref.good, ref.overflows), where
            assert t.stuck == ref_stuck, where
            assert cfg.min_scale <= state.scale <= cfg.max_scale, where
            assert math.isfinite(state.scale) and state.scale >= F32_TINY, where
            assert math.isfinite(1.0 / state.scale), where


def test_transition_is_pure():
    cfg = LossScaleConfig(init_scale=8, scale_window=1)
    s0 = cfg.initial_state()
    a = transition(s0, cfg, True)
    b = transition(s0, cfg, True)
    assert a == b and s0 == cfg.initial_state()
    with pytest.raises(AttributeError):
        s0.scale = 3.0  # frozen


# --- validation and checkpoints -------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(init_scale=0.0), "init_scale"),
    (dict(init_scale=-1.0), "init_scale"),
    (dict(init_scale=math.inf), "init_scale must be finite"),
    (dict(init_scale=math.nan), "init_scale must be finite"),
    (dict(init_scale="big"), "must be a number"),
    (dict(scale_factor=1.0), "scale_factor"),
    (dict(scale_factor=0.5), "scale_factor"),
    (dict(backoff_factor=1.0), "backoff_factor"),
    (dict(backoff_factor=0.0), "backoff_factor"),
    (dict(backoff_factor=2.0), "backoff_factor"),
    (dict(scale_window=0), "scale_window"),
    (dict(scale_window=2.5), "scale_window"),
    (dict(scale_window=True), "scale_window"),
    (dict(hysteresis=0), "hysteresis"),
    (dict(min_scale=0.0), "min_scale"),
    (dict(min_scale=1e-45), "min_scale"),        # subnormal in float32
    (dict(max_scale=1e39), "max_scale"),         # inf in float32
    (dict(min_scale=8.0, max_scale=4.0, init_scale=4.0), "above max_scale"),
    (dict(init_scale=2.0 ** 30), r"init_scale .* must lie in \[min_scale, max_scale\]"),
    (dict(on_min_scale="ignore"), "on_min_scale"),
])
def test_invalid_settings_raise_config_error_naming_the_field(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        DynamicLossScaler(**kwargs)


def test_state_dict_round_trip_continues_identically():
    a = DynamicLossScaler(init_scale=16, scale_window=3, hysteresis=2)
    seq = [False, True, False, False, True, True, False, False, False, True]
    for o in seq:
        a.update_scale(o)
    b = DynamicLossScaler(init_scale=16, scale_window=3, hysteresis=2)
    b.load_state_dict(a.state_dict())
    assert b.state == a.state
    for o in seq:
        a.update_scale(o)
        b.update_scale(o)
        assert b.state == a.state


def test_load_state_dict_rejects_foreign_or_out_of_range_state():
    s = DynamicLossScaler(init_scale=16)
    with pytest.raises(CheckpointError, match="not a DynamicLossScaler state"):
        s.load_state_dict({"loss_scale": 4.0})
    with pytest.raises(CheckpointError, match="outside"):
        s.load_state_dict({"scale": 2.0 ** 40})
    assert s.state == LossScaleState(scale=16.0)
