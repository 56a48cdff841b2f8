"""ScaleWatch fires when the loss scale is stuck and names the layers at the origin."""
import warnings

import pytest

from mixprec.errors import ConfigError, NumericsError
from mixprec.monitor import ScaleWatch, StuckScaleWarning


def test_quiet_while_scaling_works():
    w = ScaleWatch(min_scale=1.0, window=10, max_skip_fraction=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(50):  # one skip in ten: within the limit
            assert w.observe(step, 2.0 ** 15, skipped=step % 10 == 0, origin="fc") is None


def test_initial_backoffs_do_not_count_before_the_window_fills():
    w = ScaleWatch(min_scale=1.0, window=10, max_skip_fraction=0.2)
    assert all(w.observe(s, 2.0 ** (16 - s), skipped=True) is None for s in range(5))


def test_warns_on_too_many_skips_naming_the_most_frequent_origins():
    w = ScaleWatch(min_scale=1.0, window=10, max_skip_fraction=0.2)
    origins = ["blocks.3.mlp.fc2"] * 3 + ["blocks.1.attn"] + [None] * 6
    for step, o in enumerate(origins[:-1]):
        w.observe(step, 1024.0, skipped=o is not None, origin=o)
    with pytest.warns(StuckScaleWarning) as rec:
        msg = w.observe(9, 1024.0, skipped=False)
    assert msg == str(rec[0].message)
    assert "4 of the last 10 steps were skipped (limit 20%)" in msg
    assert "blocks.3.mlp.fc2 (3x), blocks.1.attn (1x)" in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rate-limited: no second warning within the window
        assert w.observe(10, 1024.0, skipped=True, origin="blocks.3.mlp.fc2") is not None


def test_raises_at_min_scale_when_configured():
    w = ScaleWatch(min_scale=1.0, window=100, on_stuck="raise")
    w.observe(0, 2.0, skipped=True, origin="head")
    with pytest.raises(NumericsError, match="at its minimum 1 .*head \\(2x\\)"):
        w.observe(1, 1.0, skipped=True, origin="head")


def test_at_a_floor_above_1_the_floor_is_named_as_the_cause_not_a_layer():
    """``min_scale=1e10``: gradients scaled by it overflow whatever a layer does; it blamed the head
    (where the trace first saw the inf) with layer fixes."""
    w = ScaleWatch(min_scale=1e10, window=100, on_stuck="raise")
    w.observe(0, 2e10, skipped=True, origin="head")
    with pytest.raises(NumericsError) as e:
        w.observe(1, 1e10, skipped=True, origin="head")
    assert str(e.value).endswith("the floor is the cause: gradients scaled by 1e+10 overflow and the "
                                 "scale may not go lower; fix: lower min_scale (e.g. min_scale=1, the default)")
    assert "keep these layers" not in str(e.value)


def test_state_round_trip_and_validation():
    w = ScaleWatch(min_scale=1.0, window=4, max_skip_fraction=0.5)
    for s in range(3):
        w.observe(s, 8.0, skipped=True, origin="a")
    w2 = ScaleWatch(min_scale=1.0, window=4, max_skip_fraction=0.5, on_stuck="raise")
    w2.load_state_dict(w.state_dict())
    with pytest.raises(NumericsError, match="a \\(3x\\)"):
        w2.observe(3, 8.0, skipped=False)
    for bad in (dict(min_scale=0), dict(min_scale=1, window=0), dict(min_scale=1, max_skip_fraction=1.5),
                dict(min_scale=1, on_stuck="ignore")):
        with pytest.raises(ConfigError):
            ScaleWatch(**bad)
