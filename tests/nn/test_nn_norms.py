"""FP32-statistics norms vs an FP64 reference, and vs a naive norm computed in FP16.

Tolerance: the result is the FP32 norm rounded once to the input dtype, so each element is within
one unit in the last place of the output dtype of the FP64 reference (relative 2**-10 for FP16,
2**-7 for BF16), plus an absolute 1e-5 for values near zero (FP32 rounding of the statistics).
"""
import pytest
import torch
from torch import nn

from mixprec.nn import MixedPrecisionLayerNorm, RMSNorm, make_norm
from mixprec.errors import ConfigError
from mixprec.precision import PRESETS, cast_module

D = 64
ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def rows(dtype: torch.dtype) -> torch.Tensor:
    """Rows of magnitude 1, 1e3, 1e4 and 6e4 (all finite in FP16 and BF16). (8, D)."""
    g = torch.Generator().manual_seed(0)
    base = torch.rand(8, D, generator=g, dtype=torch.float64) * 2 - 1
    scale = torch.tensor([1.0, 1.0, 1e3, 1e3, 1e4, 1e4, 6e4, 6e4], dtype=torch.float64)[:, None]
    x = (base * scale).to(dtype)
    assert torch.isfinite(x).all()
    return x


def affine(norm: nn.Module) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(D, generator=g))
        if getattr(norm, "bias", None) is not None:
            norm.bias.copy_(0.1 * torch.randn(D, generator=g))


def ref_layer_norm(x, w, b, eps):
    x = x.double()
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w.double() + b.double()


def ref_rms_norm(x, w, eps):
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


def naive_layer_norm_fp16(x, w, b, eps):
    """What a LayerNorm computed in FP16 does: squares of deviations above 256 overflow."""
    x, w, b = x.half(), w.half(), b.half()
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) * (x - mu)).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b, var


def assert_within_ulp(out, ref, dtype):
    err = (out.double() - ref).abs()
    bound = ref.abs() * ULP[dtype] + 1e-5
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_layer_norm_matches_fp64_reference_on_large_rows(dtype):
    norm = MixedPrecisionLayerNorm(D)
    affine(norm)
    x = rows(dtype)
    out = norm(x)
    assert out.dtype == dtype and norm.weight.dtype == torch.float32
    assert_within_ulp(out, ref_layer_norm(x, norm.weight, norm.bias, norm.eps), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_matches_fp64_reference_on_large_rows(dtype):
    norm = RMSNorm(D)
    affine(norm)
    x = rows(dtype)
    out = norm(x)
    assert out.dtype == dtype and norm.weight.dtype == torch.float32
    assert_within_ulp(out, ref_rms_norm(x, norm.weight, norm.eps), dtype)


def test_naive_fp16_layer_norm_overflows_where_ours_does_not():
    norm = MixedPrecisionLayerNorm(D)
    affine(norm)
    x = rows(torch.float16)
    naive, var = naive_layer_norm_fp16(x, norm.weight, norm.bias, norm.eps)
    ref = ref_layer_norm(x, norm.weight, norm.bias, norm.eps)
    # Rows of magnitude >= 1e3 have deviations whose squares exceed 65504: the variance is inf and
    # the normalised row collapses to the bias (error ~ O(1)); the unit-scale rows are still fine.
    assert torch.isinf(var[2:]).all() and torch.isfinite(var[:2]).all()
    assert (naive[2:].double() - ref[2:]).abs().max() > 0.5
    ours = norm(x)
    assert torch.isfinite(ours).all()
    assert_within_ulp(ours, ref, torch.float16)


def test_naive_fp16_rms_norm_overflows_where_ours_does_not():
    x = rows(torch.float16)
    ms = (x * x).mean(-1)  # in FP16
    assert torch.isinf(ms[2:]).all()
    assert torch.isfinite(RMSNorm(D)(x)).all()


@pytest.mark.parametrize("cls", [MixedPrecisionLayerNorm, RMSNorm])
def test_fp16_backward_is_finite_and_matches_fp64(cls):
    norm = cls(D)
    affine(norm)
    x = rows(torch.float16).requires_grad_()
    g = torch.Generator().manual_seed(2)
    upstream = torch.randn(8, D, generator=g, dtype=torch.float64)
    (norm(x).double() * upstream).sum().backward()
    assert x.grad.dtype == torch.float16 and torch.isfinite(x.grad).all()
    x64 = x.detach().double().requires_grad_()
    ref = (ref_layer_norm(x64, norm.weight, norm.bias, norm.eps) if cls is MixedPrecisionLayerNorm
           else ref_rms_norm(x64, norm.weight, norm.eps))
    (ref * upstream).sum().backward()
    # Gradients scale as 1/row magnitude; compare relative to each row's largest gradient.
    rel = (x.grad.double() - x64.grad).abs().amax(-1) / x64.grad.abs().amax(-1)
    assert (rel < 4e-3).all(), rel


def test_fp32_input_takes_the_fused_path_bitwise():
    ours, torch_ln = MixedPrecisionLayerNorm(D), nn.LayerNorm(D)
    affine(ours)
    torch_ln.load_state_dict(ours.state_dict())
    x = torch.randn(4, 10, D)
    assert torch.equal(ours(x), torch_ln(x))


def test_statistics_stay_fp32_under_bf16_autocast():
    norm = MixedPrecisionLayerNorm(D)
    x = rows(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = norm(x)
        fp32_in = norm(x.float())
    assert torch.equal(inside, norm(x))
    assert fp32_in.dtype == torch.float32


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_cast_module_keeps_norm_parameters_fp32(preset):
    model = nn.Sequential(nn.Linear(D, D), MixedPrecisionLayerNorm(D), RMSNorm(D))
    cast_module(model, PRESETS[preset])
    assert model[0].weight.dtype == PRESETS[preset].param_dtype
    for p in list(model[1].parameters()) + list(model[2].parameters()):
        assert p.dtype == torch.float32


def test_unknown_norm_name_is_a_config_error():
    with pytest.raises(ConfigError, match="rmsnorm"):
        make_norm("rmsnrom", D)


@pytest.mark.parametrize("cls", [MixedPrecisionLayerNorm, RMSNorm])
def test_fp64_input_is_not_degraded_to_fp32(cls):
    norm = cls(D)
    x = rows(torch.float64)
    out = norm(x)
    ref = (ref_layer_norm(x, norm.weight, norm.bias, norm.eps) if cls is MixedPrecisionLayerNorm
           else ref_rms_norm(x, norm.weight, norm.eps))
    assert out.dtype == torch.float64 and (out - ref).abs().max() < 1e-12
