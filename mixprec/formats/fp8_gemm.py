"""The FP8 GEMM ``a @ bt.T`` on each execution path, one kernel per GEMM on every path.

* ``emulated``: dequantize both operands by broadcasting their scales (no per-element scale
  tensor when the shape divides into blocks) and run ONE FP32 matmul; with
  ``accum_mantissa_bits`` the limited-precision accumulator of
  :func:`~mixprec.formats.emulation.limited_precision_matmul` instead.
* ``*-scaled-mm``: ``torch._scaled_mm`` for one scale per tensor or per row (the scales go into
  the GEMM's epilogue); DeepSeek-V3's 1x128 / 128x128 blocks through torch's native block-scaled
  ``torch.nn.functional.scaled_mm`` (the scales are applied inside the main loop, every 128 of
  K, as the recipe's "promote every 128" asks), or, where this torch has none on CUDA, through
  mixprec's Triton kernel (:mod:`mixprec.formats.fp8_triton`, the same numerics; imported only
  when a plan says so). Which of these a layer may use was decided when
  it was converted (:mod:`mixprec.formats.fp8_path`); nothing here queries hardware or catches a
  kernel's refusal.

Layouts: FP8 tensor cores take ``a`` row-major and ``b`` column-major (``bt`` row-major), with K
padded to a multiple of 16 (zero bytes are +0.0 in both FP8 formats). Transposed operands from
the layers arrive as views; their FP8 bytes are made contiguous here (a 1-byte copy), never their
high-precision source.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mixprec.formats.emulation import emulated_mm
from mixprec.formats.fp8_config import Fp8Config
from mixprec.formats.fp8_quantize import Fp8Tensor, quantize, sqnr_db

__all__ = ["fp8_gemm", "block_scaled_available", "BLOCK_SCALE_LAYOUTS"]


def _pad_k(t: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    """Row-major FP8 matrix with its last dim zero-padded to ``multiple``."""
    t = t.contiguous()
    pad = -t.shape[1] % multiple
    if not pad:
        return t
    return F.pad(t.view(torch.uint8), (0, pad)).view(t.dtype)


def _is_blocked(q: Fp8Tensor) -> bool:
    """More than one scale along the contraction (K) dimension."""
    return q.scale.dim() == 2 and q.scale.shape[1] > 1


def fp8_gemm(a: Fp8Tensor, bt: Fp8Tensor, *, path: str, config: Fp8Config, out_dtype: torch.dtype,
             rowwise_out_fp32: bool = True, block_layout: int | None = None,
             block_kernel: str | None = None) -> torch.Tensor:
    """``a @ bt.T`` for FP8 ``a`` (M, K) and ``bt`` (N, K), in ``out_dtype``, on ``path``.

    ``rowwise_out_fp32``: this torch's rowwise ``_scaled_mm`` can emit FP32 (else a non-BF16
    result is produced in BF16 and converted). ``block_kernel`` (the plan's): blocked operands
    run in mixprec's Triton kernel when ``"triton"``, else in torch's native block-scaled GEMM
    with ``block_layout``, the scale layout it accepted when probed (None: not available; they
    then run the one-GEMM emulation)."""
    blocked = _is_blocked(a) or _is_blocked(bt)
    if path == "emulated" or blocked and block_kernel != "triton" and block_layout is None:
        out = emulated_mm(a, bt, mantissa_bits=config.accum_mantissa_bits,
                          promotion_interval=config.promotion_interval, chunk=config.accum_chunk)
        return out.to(out_dtype)
    if blocked and block_kernel == "triton":
        from mixprec.formats.fp8_triton import block_scaled_mm   # lazy: the package runs without Triton
        return block_scaled_mm(a, bt, out_dtype)
    if blocked:
        return _block_scaled_mm(a, bt, out_dtype, block_layout)
    return _scaled_mm(a, bt, out_dtype, rowwise_out_fp32)


def _scaled_mm(a: Fp8Tensor, bt: Fp8Tensor, out_dtype: torch.dtype, rowwise_out_fp32: bool) -> torch.Tensor:
    """One scale per tensor or per row (along K) for each operand: one ``torch._scaled_mm``."""
    M, N = a.shape[0], bt.shape[0]
    ad, bd = _pad_k(a.data), _pad_k(bt.data)
    if a.scale.numel() == 1 and bt.scale.numel() == 1:        # tensorwise: singleton FP32 scales
        return torch._scaled_mm(ad, bd.t(), scale_a=a.scale.reshape(1, 1),
                                scale_b=bt.scale.reshape(1, 1), out_dtype=out_dtype)
    # rowwise: a's scales (M, 1), b's (1, N); a tensorwise operand is expanded to its rows.
    sa, sb = _per_row(a, M).view(M, 1), _per_row(bt, N).view(1, N)
    if rowwise_out_fp32 or out_dtype == torch.bfloat16:
        return torch._scaled_mm(ad, bd.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    return torch._scaled_mm(ad, bd.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16).to(out_dtype)


def _per_row(q: Fp8Tensor, rows: int) -> torch.Tensor:
    """``q``'s scales as a contiguous 1-D (rows,) vector (the kernel checks strides, not just
    sizes): one scale broadcast, or a block's scale repeated for each of its rows (a 128x128
    weight with a single K block)."""
    s = q.scale.reshape(-1)
    if s.numel() == 1:
        return s.expand(rows).contiguous()
    if s.numel() != rows:
        s = s.repeat_interleave(q.block[0])[:rows]
    return s.contiguous()


# --- DeepSeek-V3 blocks through torch's native block-scaled GEMM ---------------------------------

BLOCK_SCALE_LAYOUTS = ("outer-major", "transposed")
"""Scale layouts tried, in order, by :func:`block_scaled_available` for ``b``: the 1x128 scales
of ``a`` are always outer-dim-major ((M, K/128) with stride (1, M)), as torch's kernel reads
them; ``b``'s grid is passed as is (outer-major) or transposed. The probe keeps the first one
whose result matches the emulation."""


def _block_scaled_mm(a: Fp8Tensor, bt: Fp8Tensor, out_dtype: torch.dtype, layout: int) -> torch.Tensor:
    """One ``torch.nn.functional.scaled_mm`` with 1x128 scales for ``a`` and 1x128 or 128x128
    scales for ``b``; K is zero-padded to a multiple of 128 (the grids already count the ragged
    last block)."""
    from torch.nn.functional import ScalingType, scaled_mm
    ad, bd = _pad_k(a.data, 128), _pad_k(bt.data, 128)
    sa = a.scale.float().t().contiguous().t()                  # (M, nk), outer-dim-major
    b_blocks = bt.block is not None and bt.block[0] > 1
    sb = bt.scale.float()
    if BLOCK_SCALE_LAYOUTS[layout] == "transposed":
        sb = sb.t()
    elif not b_blocks:
        sb = sb.t().contiguous().t()                           # (N, nk), outer-dim-major
    return scaled_mm(ad, bd.t(), sa, ScalingType.BlockWise1x128, sb,
                     ScalingType.BlockWise128x128 if b_blocks else ScalingType.BlockWise1x128,
                     output_dtype=out_dtype)


def block_scaled_available(device: torch.device) -> int | None:
    """Probe (once per device, cached by the caller) whether this torch runs DeepSeek-V3's 1x128 x
    128x128 and 1x128 x 1x128 GEMMs natively on ``device``: returns the index of the first layout
    in :data:`BLOCK_SCALE_LAYOUTS` whose tiny GEMMs agree with the emulation (>= 40 dB), else None.
    Any error from the kernel means "not available" (this is the only place one is caught)."""
    if not (hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")):
        return None
    for layout in range(len(BLOCK_SCALE_LAYOUTS)):
        if block_gemm_agrees(lambda a, b: _block_scaled_mm(a, b, torch.float32, layout), device):
            return layout
    return None


def block_gemm_agrees(gemm, device: torch.device) -> bool:
    """Whether ``gemm(a, bt)`` (FP32 out) runs on ``device`` and agrees with the emulation
    (>= 40 dB) on tiny 1x128 x 128x128 and 1x128 x 1x128 problems (256 x 384 x 256): the probe a
    block-scaled kernel passes before a layer is planned onto it (torch's native one, and
    mixprec's Triton kernel), so that a kernel this torch or GPU refuses, or one that computes
    nonsense there, leaves blockwise on the emulation instead of failing or corrupting a run. Any
    error from the kernel means "no" (this is the only place one is caught)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(256, 384, generator=g).to(device)
    w = torch.randn(256, 384, generator=g).to(device)
    xq = quantize(x, torch.float8_e4m3fn, (1, 128))
    wq = quantize(w, torch.float8_e4m3fn, (128, 128))
    pairs = [(xq, wq), (xq, quantize(w, torch.float8_e4m3fn, (1, 128)))]
    try:
        return all(sqnr_db(emulated_mm(a, b), gemm(a, b)) >= 40.0 for a, b in pairs)
    except Exception:   # a refused layout, a compile error, an unsupported GPU: not used
        return False

