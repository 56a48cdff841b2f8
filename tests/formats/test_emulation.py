"""Emulated FP8 GEMMs and limited-precision accumulation with FP32 promotion."""
import pytest
import torch

from mixprec.formats import emulated_mm, limited_precision_matmul, quantize, round_mantissa


def test_round_mantissa_matches_fp16_and_bf16_rounding():
    # fp16 keeps 10 mantissa bits, bf16 keeps 7, both round to nearest even: exact references.
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * 8
    assert torch.equal(round_mantissa(x, 10), x.half().float())
    assert torch.equal(round_mantissa(x, 7), x.bfloat16().float())


def test_round_mantissa_keeps_specials_and_identity_at_23_bits():
    x = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.2345678])
    r = round_mantissa(x, 5)
    assert torch.equal(r[:4], x[:4]) and torch.isnan(r[4])
    assert torch.equal(round_mantissa(x[5:], 23), x[5:])


def test_emulated_gemm_equals_fp32_matmul_of_dequantized_operands():
    g = torch.Generator().manual_seed(1)
    a, bt = torch.randn(48, 256, generator=g), torch.randn(80, 256, generator=g)
    qa, qb = quantize(a, block=(1, 128)), quantize(bt, block=(128, 128))
    expected = qa.dequantize() @ qb.dequantize().t()
    assert torch.allclose(emulated_mm(qa, qb), expected, rtol=1e-6, atol=1e-5)


def _fp8_operands(M, K, N, seed):
    # positive FP8-representable operands: the sum grows with K, the worst case for a short mantissa
    g = torch.Generator().manual_seed(seed)
    a = quantize(torch.rand(M, K, generator=g), block=(1, 128)).dequantize()
    b = quantize(torch.rand(K, N, generator=g).t().contiguous(), block=(128, 128)).dequantize().t()
    return a, b


def test_limited_accumulation_error_at_k4096_and_promotion_every_128_fixes_it():
    a, b = _fp8_operands(32, 4096, 32, seed=2)
    ref = a.double() @ b.double()

    def rel_err(out):
        return float(((out.double() - ref).abs() / ref.abs()).max())

    fp32 = rel_err(a @ b)
    unpromoted = rel_err(limited_precision_matmul(a, b, mantissa_bits=14, promotion_interval=None))
    promoted = rel_err(limited_precision_matmul(a, b, mantissa_bits=14, promotion_interval=128))
    print(f"\nK=4096 max relative error: fp32 {fp32:.2e}, 14-bit accumulator {unpromoted:.2e}, "
          f"14-bit + FP32 promotion every 128 {promoted:.2e} ({unpromoted / promoted:.0f}x smaller)")
    assert unpromoted > 1e-4            # 14 bits over 4096 terms: visibly worse than FP32
    assert unpromoted / promoted >= 8   # promotion removes most of it
    assert promoted < 5e-5


def test_limited_accumulation_with_full_mantissa_is_fp32_accurate():
    a, b = _fp8_operands(16, 512, 16, seed=3)
    out = limited_precision_matmul(a, b, mantissa_bits=23, promotion_interval=128)
    assert torch.allclose(out, a @ b, rtol=1e-5)


def test_limited_accumulation_handles_k_not_multiple_of_chunk():
    a, b = _fp8_operands(8, 300, 8, seed=4)
    out = limited_precision_matmul(a, b, mantissa_bits=20, promotion_interval=64, chunk=32)
    assert torch.allclose(out, a @ b, rtol=1e-4)


def test_mantissa_bits_none_is_plain_matmul():
    a, b = torch.randn(4, 64), torch.randn(64, 4)
    assert torch.equal(limited_precision_matmul(a, b, mantissa_bits=None), a @ b)
