"""DeepSeek-V3's block-scaled FP8 GEMM as one Triton kernel, for CUDA builds of torch whose
``scaled_mm`` has no native 1x128 / 128x128 blocks.

``C = A @ B^T`` for E4M3 ``A`` (M, K) with 1x128 scales (M, ceil(K/128)) and ``B`` (N, K) with
1x128 scales (N, ceil(K/128)) or 128x128 scales (ceil(N/128), ceil(K/128)). Each program owns a
(BLOCK_M, BLOCK_N) tile of C and walks K in 128-wide blocks: one tensor-core ``tl.dot`` per block
(the hardware's own accumulator for 128 products, as DeepSeek-V3's recipe allows), then the
block's partial product is multiplied by ``a_scale[m, kb] * b_scale[n or n // 128, kb]`` and added
into an FP32 accumulator (its "promotion every 128 elements"). Ragged M, N and K are masked; the
last K block's padding loads as zero (its scale came from its real elements in the cast). The
result is stored in BF16, FP16 or FP32 (rounded to nearest from the FP32 accumulator).

Imported lazily by :mod:`mixprec.formats.fp8_gemm` (only when a layer's plan says ``triton``), so
the package imports without Triton. Under ``TRITON_INTERPRET=1`` (set before Triton is imported)
the same kernel runs on a CPU: that is how the tests check it against the emulation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mixprec.formats.fp8_quantize import Fp8Tensor

__all__ = ["block_scaled_mm"]

BLOCK_K = 128
"""The K block: one scale per 128 elements of K on both operands (fixed by the recipe)."""

TILE = dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8)
"""One output tile per program (128x128, launched in groups of 8 row tiles), 8 warps, 3 stages:
one fixed configuration, so the kernel compiles once per (B layout, output dtype) and every run
sums in the same order. Not autotuned: it has run only under the interpreter so far, with no GPU
measurement to tune against."""
LAUNCH = dict(num_warps=8, num_stages=3)


@triton.jit
def _block_scaled_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, M, N, K,
                         stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
                         stride_sam, stride_sak, stride_sbn, stride_sbk,
                         B_SCALE_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped launch order: GROUP_M row tiles share each column tile of B while it is in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    in_m = rm < M
    in_n = rn < N
    rm64, rn64 = rm.to(tl.int64), rn.to(tl.int64)        # row offsets may pass 2**31 elements
    a_rows = a_ptr + rm64[:, None] * stride_am
    b_rows = b_ptr + rn64[:, None] * stride_bn
    sa_rows = sa_ptr + rm * stride_sam
    sb_rows = sb_ptr + (rn // B_SCALE_ROWS) * stride_sbn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kb = k0 // BLOCK_K
        k = k0 + rk
        in_k = k < K
        a = tl.load(a_rows + k[None, :] * stride_ak, mask=in_m[:, None] & in_k[None, :], other=0.0)
        b = tl.load(b_rows + k[None, :] * stride_bk, mask=in_n[:, None] & in_k[None, :], other=0.0)
        partial = tl.dot(a, tl.trans(b))                      # 128 products per output, FP32
        sa = tl.load(sa_rows + kb * stride_sak, mask=in_m, other=0.0)
        sb = tl.load(sb_rows + kb * stride_sbk, mask=in_n, other=0.0)
        acc += partial * sa[:, None] * sb[None, :]            # promotion: FP32, every 128 of K
    c = c_ptr + rm64[:, None] * stride_cm + rn64[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


def block_scaled_mm(a: Fp8Tensor, bt: Fp8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ bt.T`` in ``out_dtype`` (BF16, FP16 or FP32) for E4M3 ``a`` (M, K) with 1x128 scales and
    ``bt`` (N, K) with 1x128 or 128x128 scales. Strided views (the layers' transposes) are read in
    place: nothing is copied or padded."""
    M, K = a.shape
    N = bt.shape[0]
    nk = triton.cdiv(K, BLOCK_K)
    b_rows = bt.block[0] if bt.block is not None else 1
    if a.block != (1, BLOCK_K) or bt.block not in ((1, BLOCK_K), (BLOCK_K, BLOCK_K)) or \
            a.scale.shape != (M, nk) or bt.scale.shape != (triton.cdiv(N, b_rows), nk):
        raise ValueError(f"block_scaled_mm takes 1x128 x (1x128 | 128x128) operands, got blocks "
                         f"{a.block} / {bt.block}, scales {tuple(a.scale.shape)} / "
                         f"{tuple(bt.scale.shape)} for {M}x{K} @ ({N}x{K})^T")
    if a.data.dtype != torch.float8_e4m3fn or bt.data.dtype != torch.float8_e4m3fn:
        raise ValueError(f"block_scaled_mm takes E4M3 operands, got {a.data.dtype} / {bt.data.dtype}")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"block_scaled_mm writes BF16, FP16 or FP32, not {out_dtype}")
    c = torch.empty(M, N, device=a.data.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return c
    sa, sb = a.scale.float(), bt.scale.float()
    grid = (triton.cdiv(M, TILE["BLOCK_M"]) * triton.cdiv(N, TILE["BLOCK_N"]),)
    _block_scaled_kernel[grid](a.data, bt.data, c, sa, sb, M, N, K,
                               a.data.stride(0), a.data.stride(1), bt.data.stride(0),
                               bt.data.stride(1), c.stride(0), c.stride(1), sa.stride(0),
                               sa.stride(1), sb.stride(0), sb.stride(1),
                               B_SCALE_ROWS=b_rows, BLOCK_K=BLOCK_K, **TILE, **LAUNCH)
    return c
