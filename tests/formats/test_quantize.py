"""Quantize/dequantize at every granularity against FP32, and at the edges."""
import pytest
import torch

from mixprec.errors import NumericsError
from mixprec.formats import compute_amax, quantize, sqnr_db

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BLOCKS = {"tensorwise": None, "rowwise": (1, None), "tile1x128": (1, 128), "block128": (128, 128)}


@pytest.mark.parametrize("block", BLOCKS.values(), ids=BLOCKS.keys())
def test_e4m3_gaussian_round_trip_sqnr_at_least_25db(block):
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
    q = quantize(x, E4M3, block)
    assert q.data.dtype == E4M3
    # E4M3 has 3 mantissa bits: ~31 dB on Gaussian data; 25 dB is the bound.
    assert sqnr_db(x, q.dequantize()) >= 25.0


def test_e5m2_round_trip_is_coarser_than_e4m3():
    x = torch.randn(128, 256, generator=torch.Generator().manual_seed(1))
    s4 = sqnr_db(x, quantize(x, E4M3).dequantize())
    s5 = sqnr_db(x, quantize(x, E5M2).dequantize())
    assert 18.0 <= s5 < s4 - 4.0  # one mantissa bit less is ~6 dB


@pytest.mark.parametrize("block, scale_shape", [
    (None, ()), ((1, None), (130, 1)), ((1, 128), (130, 3)), ((128, 128), (2, 3)),
])
def test_scale_shapes_follow_the_block_grid_with_ragged_last_tile(block, scale_shape):
    x = torch.randn(130, 300)  # neither dim a multiple of 128
    q = quantize(x, E4M3, block)
    assert tuple(q.scale.shape) == scale_shape and q.data.shape == x.shape
    assert sqnr_db(x, q.dequantize()) >= 25.0


def test_ragged_tile_scale_comes_from_its_real_elements():
    x = torch.ones(1, 130)
    x[0, 128:] = 7.0  # the ragged last tile holds only these two elements
    q = quantize(x, E4M3, (1, 128))
    fmax = torch.finfo(E4M3).max
    assert torch.allclose(q.scale, torch.tensor([[1.0 / fmax, 7.0 / fmax]]))
    assert torch.equal(q.dequantize(), x)


def test_all_zero_tensor_and_tiles_have_finite_scales_and_exact_zeros():
    z = torch.zeros(64, 256)
    for block in BLOCKS.values():
        q = quantize(z, E4M3, block)
        assert torch.isfinite(q.scale).all() and (q.scale > 0).all()
        assert torch.equal(q.dequantize(), z) and not bool(q.nonfinite)
    x = torch.randn(4, 256)
    x[:, :128] = 0.0  # one all-zero tile per row next to a normal one
    q = quantize(x, E4M3, (1, 128))
    assert torch.isfinite(q.scale).all()
    assert torch.equal(q.dequantize()[:, :128], x[:, :128])
    assert sqnr_db(x[:, 128:], q.dequantize()[:, 128:]) >= 25.0


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("block", BLOCKS.values(), ids=BLOCKS.keys())
def test_nonfinite_input_is_flagged_and_poisons_its_block_not_saturated(bad, block):
    x = torch.randn(8, 256)
    x[3, 5] = bad
    q = quantize(x, E4M3, block)
    assert bool(q.nonfinite)
    deq = q.dequantize()
    assert torch.isnan(deq[3, 5])  # never saturated to +-448
    if block == (1, 128):  # other tiles are untouched
        assert torch.isfinite(deq[3, 128:]).all() and torch.isfinite(deq[:3]).all()


def test_nonfinite_input_raises_when_asked():
    x = torch.randn(4, 32)
    x[0, 0] = float("inf")
    with pytest.raises(NumericsError, match="inf or NaN"):
        quantize(x, E4M3, (1, 16), raise_on_nonfinite=True, name="layer input")


def test_power_of_two_scales_are_exact_powers_and_do_not_overflow():
    x = torch.randn(64, 256) * 3.7
    q = quantize(x, E4M3, (1, 128), power_of_two=True)
    assert torch.equal(torch.exp2(torch.log2(q.scale).round()), q.scale)
    assert (q.data.float().abs() <= torch.finfo(E4M3).max).all()
    assert sqnr_db(x, q.dequantize()) >= 25.0


def test_margin_leaves_headroom():
    x = torch.randn(32, 64)
    q = quantize(x, E4M3, None, margin=2)
    assert q.data.float().abs().max() <= torch.finfo(E4M3).max / 4 + 1e-6


def test_amax_is_vectorised_per_block():
    x = torch.arange(4 * 256, dtype=torch.float32).reshape(4, 256)
    amax = compute_amax(x, (2, 128))
    assert torch.equal(amax, torch.tensor([[256.0 + 127, 511.0], [768.0 + 127, 1023.0]]))


def test_outlier_channels_blockwise_beats_tensorwise():
    """Activations with a few huge channels (as in LLMs): per-tile scales keep the rest precise."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(256, 1024, generator=g)
    x[:, [3, 100, 250, 400]] *= 1000.0  # outlier channels, all in the first half
    x[:, 512:] *= 0.01  # a quiet half whose tiles sit far below the global amax
    s_tensor = sqnr_db(x[:, 512:], quantize(x, E4M3, None).dequantize()[:, 512:])
    s_block = sqnr_db(x[:, 512:], quantize(x, E4M3, (1, 128)).dequantize()[:, 512:])
    print(f"\nquiet-half SQNR: tensorwise {s_tensor:.1f} dB, blockwise 1x128 {s_block:.1f} dB, "
          f"gain {s_block - s_tensor:.1f} dB")
    assert s_block >= 25.0
    assert s_block - s_tensor >= 10.0
