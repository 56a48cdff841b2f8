"""FP8 GEMMs without FP8 hardware: quantize-dequantize, then FP32 math.

``emulated_mm`` reproduces what an FP8 GEMM computes up to accumulation order: both operands are
rounded to FP8 with their scales (so all quantization error is real), dequantized to FP32 and
multiplied in FP32. This is for *numerics*, not speed: it is slower than a plain FP32 matmul.

``limited_precision_matmul`` additionally reproduces the accumulation error DeepSeek-V3 describes
for Hopper tensor cores (section 3.3.2 of its report): FP8 products are accumulated with only about
14 mantissa bits, so long reductions (K = 4096) lose accuracy; promoting the partial sum to an FP32
accumulator every ``N_C = 128`` elements fixes most of it. The model of the hardware:

* a tensor-core instruction sums ``chunk`` (32) products exactly (FP32 here);
* those chunk sums are added one after another into an accumulator that is rounded to
  ``mantissa_bits`` after every addition (round-to-nearest-even on the FP32 bit pattern);
* every ``promotion_interval`` elements of K the accumulator is added into an FP32 total and reset.

Vectorised over the whole (M, N) output; the only Python loop runs over K chunks (K / 32 steps).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mixprec.errors import ConfigError
from mixprec.formats.fp8_quantize import Fp8Tensor

__all__ = ["round_mantissa", "limited_precision_matmul", "emulated_mm"]


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Round FP32 ``x`` to ``bits`` explicit mantissa bits (nearest, ties to even).

    Works on the bit pattern: adding half an ULP of the target format (minus one, plus the kept
    LSB for ties-to-even) and clearing the dropped bits; a carry rolls into the exponent exactly as
    a hardware rounder's would. inf and NaN are returned unchanged.
    """
    if x.dtype != torch.float32:
        raise ConfigError(f"round_mantissa works on float32 tensors, got {x.dtype}")
    if not 0 <= bits <= 23:
        raise ConfigError(f"mantissa bits must be in 0..23, not {bits}")
    shift = 23 - bits
    if shift == 0:
        return x
    i = x.view(torch.int32)
    lsb = (i >> shift) & 1
    rounded = ((i + (1 << (shift - 1)) - 1 + lsb) & -(1 << shift)).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x)


def limited_precision_matmul(a: torch.Tensor, b: torch.Tensor, *, mantissa_bits: int | None,
                             promotion_interval: int | None = 128, chunk: int = 32) -> torch.Tensor:
    """``a @ b`` (FP32, (M, K) @ (K, N)) with a ``mantissa_bits``-bit accumulator promoted to FP32
    every ``promotion_interval`` elements of K (None = never promoted: one long limited-precision
    reduction, the failure mode). ``mantissa_bits=None`` is the plain FP32 matmul."""
    a, b = a.float(), b.float()
    if mantissa_bits is None:
        return a @ b
    M, K = a.shape
    N = b.shape[1]
    if promotion_interval is not None and (promotion_interval < chunk or promotion_interval % chunk):
        raise ConfigError(f"promotion_interval ({promotion_interval}) must be a multiple of chunk ({chunk})")
    pad = -K % chunk
    if pad:  # zero products do not change any sum
        a, b = F.pad(a, (0, pad)), F.pad(b, (0, 0, 0, pad))
    nc = (K + pad) // chunk
    per_group = nc if promotion_interval is None else promotion_interval // chunk
    a3 = a.reshape(M, nc, chunk).transpose(0, 1)  # (nc, M, chunk)
    b3 = b.reshape(nc, chunk, N)                   # (nc, chunk, N)
    total = torch.zeros(M, N, dtype=torch.float32, device=a.device)
    for g0 in range(0, nc, per_group):
        partial = torch.bmm(a3[g0:g0 + per_group], b3[g0:g0 + per_group])  # (g, M, N), exact per chunk
        acc = torch.zeros_like(total)
        for p in partial:  # the limited-precision accumulator: rounded after every addition
            acc = round_mantissa(acc + p, mantissa_bits)
        total += acc  # promotion: FP32 addition on the CUDA cores
    return total


def emulated_mm(a: Fp8Tensor, bt: Fp8Tensor, *, mantissa_bits: int | None = None,
                promotion_interval: int | None = 128, chunk: int = 32) -> torch.Tensor:
    """FP32 result of ``a @ bt.T`` for FP8 operands ``a`` (M, K) and ``bt`` (N, K)."""
    a_hp = a.dequantize(torch.float32)            # (M, K)
    b_hp = bt.dequantize(torch.float32).t()       # (K, N)
    return limited_precision_matmul(a_hp, b_hp, mantissa_bits=mantissa_bits,
                                    promotion_interval=promotion_interval, chunk=chunk)
