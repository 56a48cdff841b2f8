"""Quantize 2-D tensors to FP8 with one scale per tensor, per row, or per 2-D tile/block.

One function covers every granularity: a *block* ``(rows, cols)`` partitions the matrix, and each
block gets its own scale from its amax. ``block=None`` is one scale for the whole tensor;
``(1, None)`` is one scale per row (``None`` = the whole extent of that dimension); ``(1, 128)``
are DeepSeek-V3's activation tiles and ``(128, 128)`` its weight blocks. Shapes that are not
multiples of the block get a smaller last tile (the amax is taken over the zero-padded tile,
which is the amax of the real elements).

Conventions (the same as ``torch._scaled_mm``): the returned ``scale`` is the *dequantization*
factor, ``x ~= data.float() * scale`` block by block, i.e. ``amax / fp8_max`` (times
``2**margin``).

Edge cases, decided once here:

* an all-zero tile (or tensor) has amax 0; its amax is floored at ``EPS`` so the scale stays
  finite and positive, and its data is exactly zero;
* a tile holding inf or NaN is never saturated to the format's max (that would hide the overflow):
  its scale becomes NaN, so everything computed from it is NaN, and ``Fp8Tensor.nonfinite`` is a
  0-dim bool flag a caller can check; ``raise_on_nonfinite=True`` raises
  :class:`~mixprec.errors.NumericsError` instead (one host sync).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mixprec.errors import ConfigError, NumericsError
from mixprec.policy.dtypes import FP8_E4M3, FP8_E5M2

__all__ = ["Fp8Tensor", "quantize", "dequantize", "compute_amax", "scale_from_amax", "EPS",
           "sqnr_db"]

EPS = 1e-12
"""Floor for an amax (all-zero tiles), as in common FP8 training libraries."""

Block = tuple[int | None, int | None] | None


@dataclass(frozen=True)
class Fp8Tensor:
    """An FP8 matrix with its dequantization scales."""

    data: torch.Tensor
    """FP8 values, shape ``(R, C)``, row-major contiguous."""
    scale: torch.Tensor
    """FP32 dequantization scales: ``()`` for one scale, else ``(ceil(R/br), ceil(C/bc))``."""
    block: tuple[int, int] | None
    """Resolved block ``(br, bc)``; None for a single tensor-wide scale."""
    nonfinite: torch.Tensor
    """0-dim bool: the source held inf or NaN (the affected blocks' scales are NaN)."""

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)


def _resolve_block(block: Block, shape: torch.Size) -> tuple[int, int] | None:
    if block is None:
        return None
    br, bc = block
    return (shape[0] if br is None else int(br), shape[1] if bc is None else int(bc))


def _blocked(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """View ``x`` (R, C) as (Rb, br, Cb, bc), zero-padding a ragged last tile."""
    R, C = x.shape
    br, bc = block
    pr, pc = -R % br, -C % bc
    if pr or pc:
        x = F.pad(x, (0, pc, 0, pr))
    return x.reshape((R + pr) // br, br, (C + pc) // bc, bc)


def compute_amax(x: torch.Tensor, block: Block = None) -> torch.Tensor:
    """Max of ``|x|`` per block (FP32), NaN where a block holds a NaN. Shape as ``Fp8Tensor.scale``."""
    if x.dim() != 2:
        raise ConfigError(f"FP8 quantization works on 2-D matrices, got shape {tuple(x.shape)}; "
                          "flatten leading dimensions first (x.reshape(-1, x.shape[-1]))")
    rb = _resolve_block(block, x.shape)
    if rb is None:
        return x.abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)
    if x.numel() == 0:
        return x.new_zeros((-(-x.shape[0] // rb[0]), -(-x.shape[1] // rb[1])), dtype=torch.float32)
    return _blocked(x.abs(), rb).amax(dim=(1, 3)).float()


def scale_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype, *, margin: int = 0,
                    power_of_two: bool = False) -> torch.Tensor:
    """Dequantization scale ``amax * 2**margin / fp8_max`` per block; NaN where amax is not finite.

    With ``power_of_two`` the scale is rounded *up* to a power of two (so the quantizing multiplier,
    its reciprocal, is rounded down and nothing overflows).
    """
    fmax = torch.finfo(fp8_dtype).max
    scale = amax.float().clamp_min(EPS) * (2.0 ** margin / fmax)
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    # amax inf or NaN: poison the block instead of saturating it.
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def _expand(s: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """Per-block values (Rb, Cb) -> per-element (R, C) (materialised; used for ragged shapes)."""
    return s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: shape[0], : shape[1]]


def _apply_blockwise(x: torch.Tensor, s: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """``x * s`` with ``s`` one value per block, as FP32. Broadcasts through a (Rb, br, Cb, bc)
    view when the shape divides evenly (no per-element scale tensor), else expands ``s``."""
    x = x.float()
    if block is None:
        return x * s
    R, C = x.shape
    br, bc = block
    if R % br == 0 and C % bc == 0:
        return (x.reshape(R // br, br, C // bc, bc) * s[:, None, :, None]).reshape(R, C)
    return x * _expand(s, block, x.shape)


def quantize(x: torch.Tensor, fp8_dtype: torch.dtype = FP8_E4M3, block: Block = None, *,
             margin: int = 0, power_of_two: bool = False, amax: torch.Tensor | None = None,
             raise_on_nonfinite: bool = False, name: str = "tensor") -> Fp8Tensor:
    """Quantize a 2-D tensor to ``fp8_dtype`` with one scale per ``block`` (see module docstring).

    ``amax`` overrides the amax the scales are computed from (delayed scaling passes its history
    here; values beyond it saturate, which is what delayed scaling means). Non-finite input is still
    detected from the tensor itself.
    """
    if fp8_dtype not in (FP8_E4M3, FP8_E5M2):
        raise ConfigError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, not {fp8_dtype}")
    rb = _resolve_block(block, x.shape)
    cur_amax = compute_amax(x, block)
    nonfinite = ~torch.isfinite(cur_amax).all()
    if raise_on_nonfinite and bool(nonfinite):  # host sync, by request
        raise NumericsError(f"{name} of shape {tuple(x.shape)} contains inf or NaN before FP8 "
                            "quantization; find the producing layer with mixprec.monitor, or lower "
                            "the learning rate / loss scale")
    src_amax = cur_amax if amax is None else torch.where(torch.isfinite(cur_amax), amax, cur_amax)
    scale = scale_from_amax(src_amax, fp8_dtype, margin=margin, power_of_two=power_of_two)
    fmax = torch.finfo(fp8_dtype).max
    inv = scale.reciprocal()  # the quantizing multiplier; NaN stays NaN
    # clamp only rounds finite values that sit just above fmax after scaling (or beyond a delayed
    # amax); NaN passes through clamp unchanged, and inf inputs already have a NaN multiplier.
    data = _apply_blockwise(x, inv, rb).clamp_(-fmax, fmax).to(fp8_dtype)
    return Fp8Tensor(data=data.contiguous(), scale=scale, block=rb, nonfinite=nonfinite)


def dequantize(q: Fp8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q.data * q.scale`` block by block, in ``dtype``."""
    return _apply_blockwise(q.data, q.scale, q.block).to(dtype)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``20 log10(||ref|| / ||ref - approx||)``."""
    ref = reference.detach().double()
    noise = (ref - approx.detach().double()).norm()
    if noise == 0:
        return float("inf")
    return float(20 * torch.log10(ref.norm() / noise))
