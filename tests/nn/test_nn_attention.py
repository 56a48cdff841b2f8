"""Attention: explicit FP32-softmax path vs SDPA vs an FP64 reference.

Tolerances: FP32 inputs, both paths within 1e-5 of FP64. BF16 inputs (as under autocast): both
paths within one BF16 rounding (2**-8 * max|v|) of the FP64 reference computed on the same
BF16-rounded q, k, v; a softmax done in BF16 is shown to miss that.
"""
import math

import pytest
import torch

from mixprec.errors import ConfigError
from mixprec.nn import CausalSelfAttention, causal_attention_fp32_softmax


def qkv(dtype, B=2, H=4, T=32, hs=16, scale=1.0):
    g = torch.Generator().manual_seed(0)
    return [(scale * torch.randn(B, H, T, hs, generator=g)).to(dtype) for _ in range(3)]


def reference(q, k, v):
    q, k, v = q.double(), k.double(), v.double()
    T = q.shape[-2]
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def test_fp32_math_and_sdpa_match_fp64_reference():
    q, k, v = qkv(torch.float32)
    ref = reference(q, k, v)
    math_out = causal_attention_fp32_softmax(q, k, v)
    sdpa_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (math_out.double() - ref).abs().max() < 1e-5
    assert (sdpa_out.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("score_scale", [1.0, 4.0])
def test_bf16_sdpa_is_as_accurate_as_an_fp32_softmax(score_scale):
    q, k, v = qkv(torch.bfloat16, scale=score_scale)  # scale 4: peaked softmax, large logits
    ref = reference(q, k, v)
    math_err = (causal_attention_fp32_softmax(q, k, v).double() - ref).abs().max().item()
    sdpa_err = (torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).double()
                - ref).abs().max().item()
    bound = 2.0 ** -8 * v.abs().max().item()  # one BF16 rounding of the largest possible output
    assert math_err < bound and sdpa_err < bound
    # A softmax done in BF16 is measurably worse than either: this is what the FP32 path buys.
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    T = q.shape[-2]
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    p16 = torch.exp(s - s.amax(-1, keepdim=True))  # bf16 exp
    p16 = p16 / p16.sum(-1, keepdim=True)  # bf16 sum
    bf16_err = ((p16 @ v).double() - ref).abs().max().item()
    assert bf16_err > max(math_err, sdpa_err)


def test_module_paths_agree_and_are_causal():
    torch.manual_seed(0)
    attn = CausalSelfAttention(64, 4)
    x = torch.randn(2, 16, 64)
    y_sdpa = attn(x)
    attn.impl = "math"
    y_math = attn(x)
    assert y_sdpa.shape == (2, 16, 64)
    torch.testing.assert_close(y_math, y_sdpa, rtol=1e-5, atol=1e-5)
    # Changing a future token must not change earlier outputs.
    x2 = x.clone()
    x2[:, 10:] += 1.0
    torch.testing.assert_close(attn(x2)[:, :10], y_math[:, :10], rtol=0, atol=1e-6)


def test_module_under_bf16_autocast_matches_fp32_module():
    torch.manual_seed(0)
    attn = CausalSelfAttention(64, 4, impl="math")
    x = torch.randn(2, 16, 64)
    ref = attn(x)
    for impl in ("math", "sdpa"):
        attn.impl = impl
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = attn(x)
        assert out.dtype == torch.bfloat16
        # Linear layers in BF16 dominate the error: 3 roundings of ~2**-8 on O(0.1) values.
        torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=5e-3)


def test_dropout_only_in_training():
    torch.manual_seed(0)
    attn = CausalSelfAttention(32, 2, dropout=0.5)
    x = torch.randn(1, 8, 32)
    attn.eval()
    assert torch.equal(attn(x), attn(x))
    attn.train()
    assert not torch.equal(attn(x), attn(x))


def test_bad_shapes_and_impl_are_config_errors():
    with pytest.raises(ConfigError, match="divisible"):
        CausalSelfAttention(30, 4)
    with pytest.raises(ConfigError, match="impl"):
        CausalSelfAttention(32, 4, impl="flash")


def test_cpu_sdpa_runs_16bit_attention_in_fp32_without_amx(monkeypatch):
    import mixprec.nn.attention as attention
    monkeypatch.setattr(attention, "cpu_matrix_flags", lambda: ["avx512_bf16"])
    torch.manual_seed(0)
    layer = CausalSelfAttention(64, 4)
    x = torch.randn(2, 16, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        q, k, v = layer.qkv(x).split(64, dim=2)
    q, k, v = (t.view(2, 16, 4, 16).transpose(1, 2) for t in (q, k, v))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = layer.proj(expected.transpose(1, 2).reshape(2, 16, 64))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, expected, rtol=0, atol=0)     # the FP32 kernel, rounded once
    y.float().sum().backward()
    assert layer.qkv.weight.grad is not None and torch.isfinite(x.grad).all()


def test_cpu_sdpa_keeps_the_16bit_kernel_on_amx(monkeypatch):
    import mixprec.nn.attention as attention
    monkeypatch.setattr(attention, "cpu_matrix_flags", lambda: ["amx_bf16", "avx512_bf16"])
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    assert attention._sdpa_upcast_dtype(q) is None
    assert attention._sdpa_upcast_dtype(q.float()) is None          # FP32 input: nothing to do
    monkeypatch.setattr(attention, "cpu_matrix_flags", lambda: [])
    assert attention._sdpa_upcast_dtype(q) == torch.float32         # AVX2-only: emulated BF16


def test_cpu_sdpa_keeps_the_16bit_kernel_for_long_sequences(monkeypatch):
    import mixprec.nn.attention as attention
    monkeypatch.setattr(attention, "cpu_matrix_flags", lambda: ["avx512_bf16"])
    assert attention._sdpa_upcast_dtype(torch.zeros(1, 1, 256, 32, dtype=torch.bfloat16)) == torch.float32
    assert attention._sdpa_upcast_dtype(torch.zeros(1, 1, 512, 32, dtype=torch.bfloat16)) is None
    assert attention._sdpa_upcast_dtype(torch.zeros(1, 1, 256, 64, dtype=torch.bfloat16)) is None


def test_attention_under_torch_compile_raises_no_lru_cache_warning():
    # compile=true: the forward asks the CPU's flags (mixprec/policy/hardware.py); Dynamo warned
    # about the functools.cache around them on every run.
    import warnings
    attn = CausalSelfAttention(d_model=16, num_heads=2).to(torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(attn, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(torch.randn(2, 8, 16, dtype=torch.bfloat16))
    torch._dynamo.reset()
    assert not [w for w in caught if "lru_cache" in str(w.message)], [str(w.message)[:120] for w in caught]
