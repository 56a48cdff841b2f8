"""MXFP8 / MXFP4 / NVFP4 quantizers: hand-computed cases. (Bit for bit against torchao:
``test_mx_golden.py`` from stored vectors, always; ``test_mx_torchao.py`` live, where torchao is
installed. Kept apart so that a missing torchao never skips these.)"""
from __future__ import annotations

import pytest
import torch

from mixprec.formats import E2M1_VALUES, ELEMENTS, quantize_mx, quantize_nvfp4, round_to_grid

E2M1 = torch.tensor(E2M1_VALUES)


def _mx(x, element="e4m3", **kw):
    return quantize_mx(torch.as_tensor(x, dtype=torch.float32).reshape(1, -1), element, **kw)


# --- E2M1 elements, by hand -------------------------------------------------------------------

def test_every_e2m1_value_round_trips_exactly_with_unit_scale():
    # Block max 6 -> shared exponent floor(log2 6) - 2 = 0: scale 1, so elements are the values.
    vals = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES[1:]))
    x = torch.cat([vals, torch.zeros(32 - vals.numel())])
    q = _mx(x, "e2m1")
    assert q.scale_bits.tolist() == [[127]]
    assert torch.equal(q.dequantize().flatten(), x)
    # codes are the index in E2M1_VALUES, bit 3 the sign
    assert q.codes.flatten()[:8].tolist() == list(range(8))
    assert q.codes.flatten()[8:15].tolist() == [8 + i for i in range(1, 8)]


@pytest.mark.parametrize("value,expected", [
    (0.25, 0.0), (0.26, 0.5), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0),
    (5.0, 4.0), (5.01, 6.0), (2.9, 3.0), (0.1, 0.0),
])
def test_e2m1_rounds_to_nearest_ties_to_even(value, expected):
    x = torch.zeros(32)
    x[0], x[1] = 6.0, value            # keep the scale at 1
    assert float(_mx(x, "e2m1").dequantize()[0, 1]) == expected
    x[1] = -value
    assert float(_mx(x, "e2m1").dequantize()[0, 1]) == -expected


def test_round_to_grid_matches_the_torch_fp8_cast_on_every_e4m3_midpoint():
    grid = ELEMENTS["e4m3"].grid()
    mids = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, grid[:-1] + (grid[1:] - grid[:-1]) * 0.3])
    idx = round_to_grid(mids, grid)
    assert torch.equal(grid[idx], mids.to(torch.float8_e4m3fn).float())


def test_stochastic_rounding_is_unbiased_and_only_hits_neighbours():
    g = torch.Generator().manual_seed(0)
    a = torch.full((200_000,), 2.6)
    idx = round_to_grid(a, E2M1, rounding="stochastic", generator=g)
    vals = E2M1[idx]
    assert set(vals.unique().tolist()) == {2.0, 3.0}
    assert abs(float(vals.mean()) - 2.6) < 0.005          # p(up) = 0.6; 5 sigma ~ 0.0055
    exact = round_to_grid(torch.tensor(E2M1_VALUES), E2M1, rounding="stochastic", generator=g)
    assert exact.tolist() == list(range(8))               # representable values never move


# --- E8M0 scales, by hand ---------------------------------------------------------------------

@pytest.mark.parametrize("element,amax,shared", [
    ("e4m3", 448.0, 0), ("e4m3", 1.0, -8), ("e4m3", 1.9, -8), ("e4m3", 2.0, -7),
    ("e5m2", 1.0, -15), ("e2m1", 6.0, 0), ("e2m1", 1.0, -2), ("e2m1", 7.99, 0), ("e2m1", 8.0, 1),
])
def test_shared_exponent_is_floor_log2_amax_minus_emax(element, amax, shared):
    x = torch.zeros(32)
    x[3] = amax
    q = _mx(x, element)
    assert int(q.scale_bits) == shared + 127
    assert float(q.scale) == 2.0 ** shared


def test_floor_scaling_clamps_a_block_max_above_the_element_max():
    # amax 1.9 -> scale 2**-8 -> 1.9 * 256 = 486.4 > 448: clamped to 448 (the OCP algorithm).
    x = torch.zeros(32)
    x[0] = 1.9
    assert float(_mx(x).dequantize()[0, 0]) == 448 * 2.0 ** -8


def test_all_zero_block_gets_the_smallest_scale_and_zero_data():
    q = _mx(torch.zeros(64))
    assert q.scale_bits.tolist() == [[0, 0]]
    assert torch.equal(q.dequantize(), torch.zeros(1, 64))
    n = quantize_nvfp4(torch.zeros(2, 32))
    assert torch.isfinite(n.tensor_scale) and torch.equal(n.dequantize(), torch.zeros(2, 32))


def test_tiny_and_subnormal_blocks_clamp_the_scale_at_two_to_minus_127():
    x = torch.zeros(32)
    x[0], x[1] = 2.0 ** -140, 2.0 ** -149          # fp32 subnormals
    q = _mx(x)
    assert int(q.scale_bits) == 0                   # 2**-127 (below it E8M0 cannot go)
    # 2**-140 / 2**-127 = 2**-13: below E4M3's smallest subnormal 2**-9 -> 0
    assert torch.equal(q.dequantize(), torch.zeros(1, 32))
    x[0] = 2.0 ** -130                               # 2**-3 after scaling: exact in E4M3
    assert float(_mx(x).dequantize()[0, 0]) == 2.0 ** -130


def test_e4m3_subnormal_elements_survive_inside_a_block():
    x = torch.zeros(32)
    x[0], x[1], x[2] = 448.0, 2.0 ** -9, 3 * 2.0 ** -9       # scale 1: E4M3 subnormals
    assert _mx(x).dequantize()[0, :3].tolist() == [448.0, 2.0 ** -9, 3 * 2.0 ** -9]
    x[1] = 2.0 ** -10                                          # half the smallest: tie -> 0
    assert float(_mx(x).dequantize()[0, 1]) == 0.0


@pytest.mark.parametrize("element", ["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_block_holding_inf_or_nan_is_poisoned_never_saturated(element, bad):
    x = torch.randn(64)
    x[5] = bad
    q = _mx(x, element)
    assert q.scale_bits.tolist()[0][0] == 255 and q.scale_bits.tolist()[0][1] != 255
    d = q.dequantize()
    assert torch.isnan(d[0, :32]).all() and torch.isfinite(d[0, 32:]).all()


def test_nvfp4_non_finite_input_poisons_the_tensor():
    x = torch.randn(4, 32)
    x[1, 3] = float("inf")
    assert torch.isnan(quantize_nvfp4(x).dequantize()).all()


# --- NVFP4, by hand ---------------------------------------------------------------------------

def test_nvfp4_largest_block_scale_lands_on_e4m3_max():
    x = torch.zeros(2, 16)
    x[0, 0], x[1, 0] = 12.0, 3.0
    q = quantize_nvfp4(x)
    assert float(q.tensor_scale) == pytest.approx(12.0 / (448 * 6), rel=1e-7)
    assert q.scale_bits.float().flatten().tolist() == [448.0, 112.0]
    assert q.dequantize()[:, 0].tolist() == pytest.approx([12.0, 3.0], rel=1e-6)


def test_nvfp4_2d_weight_blocks_give_the_same_values_to_the_transpose():
    w = torch.randn(32, 48)
    q = quantize_nvfp4(w, block=(16, 16))
    qt = quantize_nvfp4(w.t().contiguous(), block=(16, 16))
    assert q.scale_bits.shape == (2, 3)
    assert torch.equal(q.dequantize().t(), qt.dequantize())


def test_ragged_shapes_pad_with_zeros():
    x = torch.randn(3, 40)
    q = quantize_mx(x, "e4m3")
    assert q.scale_bits.shape == (3, 2) and q.dequantize().shape == (3, 40)
    ref = quantize_mx(torch.cat([x, torch.zeros(3, 24)], 1), "e4m3").dequantize()[:, :40]
    assert torch.equal(q.dequantize(), ref)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_e2m1_fast_path_equals_the_grid_rounding(rounding):
    from mixprec.formats.mx import _to_e2m1
    v = torch.cat([torch.linspace(-6, 6, 4801), torch.tensor(E2M1_VALUES) / 2 + 0.25])  # grid + ties
    if rounding == "nearest":
        codes = _to_e2m1(v, "nearest", None)
        want = round_to_grid(v.abs(), E2M1)
        assert torch.equal(codes & 7, want.to(torch.uint8))
        assert torch.equal((codes >> 3).bool(), torch.signbit(v))
    else:
        g = torch.Generator().manual_seed(0)
        a = torch.full((100_000,), 4.5)
        vals = E2M1[(_to_e2m1(a, "stochastic", g) & 7).long()]
        assert set(vals.unique().tolist()) == {4.0, 6.0} and abs(float(vals.mean()) - 4.5) < 0.02


def test_lost_share_counts_flushed_and_clamped_elements():
    from mixprec.formats.mx import lost_share
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 2] = 6.0, 0.1, 1.0          # 0.1 flushes to 0 in E2M1 at scale 1
    assert float(lost_share(x, quantize_mx(x, "e2m1"))) == pytest.approx(1 / 3)
    y = torch.zeros(1, 32)
    y[0, 0], y[0, 1] = 1.9, 0.5                         # 1.9 * 2**8 = 486 > 448 + 16: clamped
    assert float(lost_share(y, quantize_mx(y, "e4m3"))) == 0.5


def test_the_replanner_measures_micro_formats_too():
    from mixprec.monitor.replan import flushed_share
    x = torch.randn(8, 64)
    x[:, 3] *= 1e4                                      # an outlier channel in the first blocks
    assert float(flushed_share(x, "nvfp4")) > 0.1 > float(flushed_share(x, "bf16"))
