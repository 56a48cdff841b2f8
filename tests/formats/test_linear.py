"""Fp8Linear: FP8 forward and both backward GEMMs per recipe, checked against FP32."""
import logging

import pytest
import torch
from torch import nn

from mixprec.errors import NumericsError
from mixprec.formats import Fp8Config, Fp8Linear, sqnr_db
from mixprec.policy.hardware import cuda_supports_fp8

RECIPES = ["tensorwise", "delayed", "rowwise", "blockwise"]
_TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


def _reference(lin, x, g):
    x = x.clone().requires_grad_()
    lin.zero_grad(set_to_none=True)
    y = lin(x)
    y.backward(g)
    return y.detach(), x.grad, lin.weight.grad.clone(), lin.bias.grad.clone()


def _fp8_run(lin, cfg, x, g):
    m = Fp8Linear.from_linear(lin, cfg)
    x = x.clone().requires_grad_()
    lin.zero_grad(set_to_none=True)
    y = m(x)
    y.backward(g)
    return m, (y.detach(), x.grad, lin.weight.grad.clone(), lin.bias.grad.clone())


def _problem(k=320, n=192, lead=(2, 45), seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * k ** -0.5)
    x = torch.randn(*lead, k, generator=g)
    grad = torch.randn(*lead, n, generator=g)
    return lin, x, grad


@pytest.mark.parametrize("recipe", RECIPES)
def test_output_and_both_grads_within_18db_of_fp32(recipe):
    lin, x, g = _problem()  # K=320 is not a multiple of 128: ragged tiles; 90 tokens
    ref = _reference(lin, x, g)
    m, out = _fp8_run(lin, Fp8Config.from_recipe(recipe), x, g)
    assert m.execution_path == "emulated"
    for what, r, o in zip(("output", "grad_input", "grad_weight"), ref, out):
        s = sqnr_db(r, o)
        assert s >= 18.0, f"{recipe} {what}: {s:.1f} dB"
    assert torch.allclose(out[3], ref[3], rtol=1e-5, atol=1e-5)  # bias grad stays exact


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("k, n", [(320, 192), (64, 208)])
def test_scaled_mm_code_path_matches_emulation(recipe, k, n):
    """The torch._scaled_mm path (run by PyTorch's CPU FP8 kernel here) computes what the
    emulation computes: checks operand layouts, scale shapes and K padding of the GPU path
    (320: ragged last 128-block; 64: a single K-block; 208: a ragged weight block)."""
    if recipe != "tensorwise" and _TORCH < (2, 13):
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales only (2.13 takes all)")
    lin, x, g = _problem(k=k, n=n, lead=(3, 30))  # 90 tokens: the wgrad GEMM needs K padding
    _, emu = _fp8_run(lin, Fp8Config.from_recipe(recipe, backend="emulated"), x, g)
    m, smm = _fp8_run(lin, Fp8Config.from_recipe(recipe, backend="scaled-mm"), x, g)
    if recipe == "blockwise":  # this CPU torch has no native block-scaled GEMM: said at conversion
        assert m.execution_path == "emulated" and "block-scaled" in m.execution_reason
    else:
        assert m.execution_path == "cpu-scaled-mm"
    for e, s in zip(emu, smm):
        assert sqnr_db(e, s) >= 60.0  # equal up to FP32 summation order


def test_high_precision_wgrad_keeps_weight_gradient_fp32():
    lin, x, g = _problem()
    ref = _reference(lin, x, g)
    _, fp8 = _fp8_run(lin, Fp8Config.from_recipe("blockwise"), x, g)
    _, hp = _fp8_run(lin, Fp8Config.from_recipe("blockwise", high_precision_wgrad=True), x, g)
    assert torch.allclose(hp[2], ref[2], rtol=1e-4, atol=1e-5)
    assert sqnr_db(ref[2], hp[2]) > sqnr_db(ref[2], fp8[2]) + 20


def test_master_weights_untouched_and_parameters_shared():
    lin, x, g = _problem()
    before = lin.weight.detach().clone()
    m, _ = _fp8_run(lin, Fp8Config.from_recipe("blockwise"), x, g)
    assert m.weight is lin.weight and m.bias is lin.bias
    assert m.weight.dtype == torch.float32 and torch.equal(m.weight.detach(), before)


def test_execution_path_is_decided_and_logged_once_at_conversion(caplog):
    lin, x, _ = _problem()
    with caplog.at_level(logging.INFO, logger="mixprec.formats"):
        m = Fp8Linear.from_linear(lin, Fp8Config.from_recipe("rowwise"), fqn="blocks.0.fc")
    assert m.execution_path == "emulated" and "no FP8 GEMM hardware" in m.execution_reason
    assert "blocks.0.fc" in caplog.text and "emulated path" in caplog.text
    assert caplog.text.count("emulated path") == 1
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="mixprec"):
        m(x)
        m(x)
    assert caplog.text == ""  # forward decides and logs nothing
    assert "path=emulated" in repr(m)


def test_delayed_scaling_records_amax_history():
    lin, x, g = _problem()
    m = Fp8Linear.from_linear(lin, Fp8Config.from_recipe("delayed", amax_history_len=4))
    for step in range(2):
        m(x * (step + 1)).backward(g)
    hist = m.amax_history
    assert hist.shape == (3, 4)
    assert torch.allclose(hist[0, :2], torch.stack([(2 * x).abs().max(), x.abs().max()]))
    assert hist[2, 0] > 0 and hist[0, 2:].eq(0).all()
    assert "amax_history" not in m.state_dict()  # checkpoints stay interchangeable with nn.Linear


def test_nonfinite_input_propagates_as_nan_or_raises():
    lin, x, _ = _problem()
    x[0, 0, 0] = float("inf")
    out = Fp8Linear.from_linear(lin, Fp8Config.from_recipe("blockwise"))(x)
    assert torch.isnan(out[0, 0]).all()  # not saturated to a finite value
    assert torch.isfinite(out[1]).all()  # other tokens' tiles are unaffected
    strict = Fp8Linear.from_linear(lin, Fp8Config.from_recipe("blockwise", nonfinite="raise"))
    with pytest.raises(NumericsError, match="input"):
        strict(x)


def test_output_follows_autocast_dtype():
    lin, x, _ = _problem(k=64, n=32, lead=(4,))
    m = Fp8Linear.from_linear(lin, Fp8Config.from_recipe("tensorwise"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    assert m(x).dtype == torch.float32


def test_limited_precision_accumulation_inside_the_layer():
    lin, x, g = _problem(k=256, n=32, lead=(8,))
    exact = Fp8Linear.from_linear(lin, Fp8Config.from_recipe("blockwise"))(x)
    cfg = Fp8Config.from_recipe("blockwise", accum_mantissa_bits=8, promotion_interval=256)
    m = Fp8Linear.from_linear(lin, cfg)
    coarse = m(x)
    assert m.execution_path == "emulated"
    assert 0 < (coarse - exact).abs().max() and sqnr_db(exact, coarse) > 25


@pytest.mark.skipif(not cuda_supports_fp8(), reason="needs a CUDA GPU with FP8 tensor cores")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_cuda_fp8_path_runs_and_matches_emulation(recipe):
    lin, x, g = _problem(k=512, n=256, lead=(4, 64))
    lin, x, g = lin.cuda(), x.cuda(), g.cuda()
    _, emu = _fp8_run(lin, Fp8Config.from_recipe(recipe, backend="emulated"), x, g)
    m, real = _fp8_run(lin, Fp8Config.from_recipe(recipe), x, g)
    assert m.execution_path == "cuda-scaled-mm"
    for e, r in zip(emu, real):
        assert sqnr_db(e, r) >= 40.0
