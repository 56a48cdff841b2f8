"""Opt-in activation clamping: bounds, counts, filters, removal."""
import pytest
import torch
from torch import nn

from mixprec.errors import ConfigError
from mixprec.nn import DEFAULT_CLAMP_BOUND, clamp_activations


def model_with_big_outputs() -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with torch.no_grad():
        m[0].weight.fill_(1e4)  # outputs ~ 1e4 * sum(x): far beyond the bound below
    return m


def test_default_bound_is_half_the_fp16_range():
    assert DEFAULT_CLAMP_BOUND == pytest.approx(65504 / 2)


def test_clamps_into_bound_counts_and_removes():
    m = model_with_big_outputs()
    x = torch.ones(3, 8)
    unclamped = m[0](x)
    with clamp_activations(m, bound=100.0) as handle:
        assert handle.module_names == ["0", "2"]
        first = m[0](x)
        assert first.abs().max() <= 100.0
        m(x)
        counts = handle.counts
    assert counts["0"] == 2 * int((unclamped.abs() > 100).sum())  # two forwards of layer 0
    assert counts["2"] == int((m[2](torch.relu(first)).abs() > 100).sum())
    assert handle.total == counts["0"] + counts["2"]
    assert torch.equal(m[0](x), unclamped)  # removed on leaving the block
    handle.reset()
    assert handle.total == 0


def test_filter_selects_modules_and_values_inside_bound_are_untouched():
    m = model_with_big_outputs()
    x = torch.randn(4, 8) * 1e-3
    ref = m(x)
    handle = clamp_activations(m, module_filter_fn=lambda name, mod: name == "2")
    assert handle.module_names == ["2"]
    assert ref.abs().max() < DEFAULT_CLAMP_BOUND
    assert torch.equal(m(x), ref) and handle.counts == {"2": 0}
    handle.remove()


def test_clamp_keeps_fp16_finite_where_unclamped_overflows():
    m = model_with_big_outputs().half()
    x = torch.full((2, 8), 2.0, dtype=torch.float16)
    assert torch.isinf(m[0](x)).any()  # 1e4 * 16 = 1.6e5 > 65504
    with clamp_activations(m):
        assert torch.isfinite(m[0](x)).all()


def test_not_installed_by_default_and_rejects_bad_input():
    m = model_with_big_outputs()
    assert not m[0]._forward_hooks
    with pytest.raises(ConfigError, match="bound"):
        clamp_activations(m, bound=0)
    with pytest.raises(ConfigError, match="matched no module"):
        clamp_activations(m, module_filter_fn=lambda n, mod: False)
