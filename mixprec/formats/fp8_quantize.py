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
  its scale becomes non-finite (inf for an inf, NaN for a NaN), so everything computed from it is
  inf or NaN, and ``Fp8Tensor.nonfinite`` is a 0-dim bool a caller can check (computed when read);
  ``raise_on_nonfinite=True`` raises :class:`~mixprec.errors.NumericsError` instead (one host sync).

The casts themselves live in :mod:`mixprec.formats.fp8_cast` (one lean function per granularity);
this module is the general, validated entry point and the :class:`Fp8Tensor` container.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mixprec.errors import ConfigError, NumericsError
from mixprec.formats.fp8_cast import (EPS, cast_128x128, cast_1x128, cast_rowwise, cast_tensorwise,
                                      cast_with_amax)
from mixprec.policy.dtypes import FP8_E4M3, FP8_E5M2

__all__ = ["Fp8Tensor", "quantize", "dequantize", "compute_amax", "scale_from_amax", "EPS",
           "sqnr_db"]

Block = tuple[int | None, int | None] | None


@dataclass(frozen=True)
class Fp8Tensor:
    """An FP8 matrix with its dequantization scales."""

    data: torch.Tensor
    """FP8 values, shape ``(R, C)`` (row-major from :func:`quantize`; the layers also pass
    transposed views, whose scales are the transposed grid)."""
    scale: torch.Tensor
    """FP32 dequantization scales: ``()`` or ``(1, 1)`` for one scale, else
    ``(ceil(R/br), ceil(C/bc))``."""
    block: tuple[int, int] | None
    """Resolved block ``(br, bc)``; None for a single tensor-wide scale."""

    @property
    def nonfinite(self) -> torch.Tensor:
        """0-dim bool: the source held inf or NaN (the affected blocks' scales are not finite).
        Computed when read, from the small scale tensor: the cast itself never checks."""
        return ~torch.isfinite(self.scale).all()

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def t(self) -> "Fp8Tensor":
        """The transpose, free: a view of the data with the transposed scale grid."""
        block = None if self.block is None else (self.block[1], self.block[0])
        return Fp8Tensor(self.data.t(), self.scale.t() if self.scale.dim() == 2 else self.scale,
                         block)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)


def _resolve_block(block: Block, shape: torch.Size) -> tuple[int, int] | None:
    if block is None:
        return None
    br, bc = block
    return (shape[0] if br is None else int(br), shape[1] if bc is None else int(bc))


def _check_2d(x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ConfigError(f"FP8 quantization works on 2-D matrices, got shape {tuple(x.shape)}; "
                          "flatten leading dimensions first (x.reshape(-1, x.shape[-1]))")


def compute_amax(x: torch.Tensor, block: Block = None) -> torch.Tensor:
    """Max of ``|x|`` per block (FP32), NaN where a block holds a NaN. Shape as ``Fp8Tensor.scale``."""
    _check_2d(x)
    rb = _resolve_block(block, x.shape)
    inf = float("inf")
    if rb is None:
        return torch.linalg.vector_norm(x, inf).float() if x.numel() else \
            x.new_zeros((), dtype=torch.float32)
    R, C = x.shape
    br, bc = rb
    if x.numel() == 0:
        return x.new_zeros((-(-R // br), -(-C // bc)), dtype=torch.float32)
    pr, pc = -R % br, -C % bc
    if pr or pc:
        x = F.pad(x, (0, pc, 0, pr))
    v = x.reshape((R + pr) // br, br, (C + pc) // bc, bc)
    return torch.linalg.vector_norm(v, inf, dim=(1, 3)).float()


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


def _broadcastable(s: torch.Tensor, shape: torch.Size) -> bool:
    return s.dim() < 2 or (s.shape[0] in (1, shape[0]) and s.shape[1] in (1, shape[1]))


def _expand(s: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """Per-block values (Rb, Cb) -> per-element (R, C) (materialised; used for ragged shapes)."""
    return s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: shape[0], : shape[1]]


def _apply_blockwise(x: torch.Tensor, s: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """``x * s`` with ``s`` one value per block, as FP32, in one broadcast multiply: directly when
    ``s`` already broadcasts (one scale, per row, per column), else through a (Rb, br, Cb, bc)
    view when the shape divides evenly (no per-element scale tensor), else by expanding ``s``."""
    x = x.float()
    if block is None or _broadcastable(s, x.shape):
        return x * s
    R, C = x.shape
    br, bc = block
    if R % br == 0 and C % bc == 0:
        return (x.reshape(R // br, br, C // bc, bc) * s[:, None, :, None]).reshape(R, C)
    return x * _expand(s, block, x.shape)


def _cast(x: torch.Tensor, fp8_dtype: torch.dtype, rb: tuple[int, int] | None, *, margin: int,
          power_of_two: bool, flag: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The lean cast of :mod:`~mixprec.formats.fp8_cast` for a resolved block (grid-shaped scale)."""
    kw = {"margin": margin, "power_of_two": power_of_two, "flag": flag}
    R, C = x.shape
    if rb is None:
        return cast_tensorwise(x, fp8_dtype, **kw)
    br, bc = rb
    if br == 1 and bc >= C:
        return cast_rowwise(x, fp8_dtype, dim=1, **kw)
    if br >= R and bc == 1:
        return cast_rowwise(x, fp8_dtype, dim=0, **kw)
    if br == 1:
        return cast_1x128(x, fp8_dtype, dim=1, tile=bc, **kw)
    if bc == 1:
        return cast_1x128(x, fp8_dtype, dim=0, tile=br, **kw)
    return cast_128x128(x, fp8_dtype, block=(br, bc), **kw)


def quantize(x: torch.Tensor, fp8_dtype: torch.dtype = FP8_E4M3, block: Block = None, *,
             margin: int = 0, power_of_two: bool = False, amax: torch.Tensor | None = None,
             raise_on_nonfinite: bool = False, name: str = "tensor") -> Fp8Tensor:
    """Quantize a 2-D tensor to ``fp8_dtype`` with one scale per ``block`` (see module docstring).

    ``amax`` (one scale per tensor only) overrides the amax the scale is computed from (delayed
    scaling passes its history here; values beyond it saturate, which is what delayed scaling
    means). Non-finite input is still detected from the tensor itself.
    """
    if fp8_dtype not in (FP8_E4M3, FP8_E5M2):
        raise ConfigError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, not {fp8_dtype}")
    _check_2d(x)
    rb = _resolve_block(block, x.shape)
    if amax is not None:
        if rb is not None:
            raise ConfigError("an explicit amax (delayed scaling) gives one scale per tensor; "
                              "pass block=None")
        data, scale = cast_with_amax(x, fp8_dtype, amax, margin=margin, power_of_two=power_of_two)
    elif x.numel() == 0:
        data = x.to(fp8_dtype)
        scale = (torch.ones(1, 1, device=x.device) if rb is None else
                 torch.ones(-(-x.shape[0] // rb[0]), -(-x.shape[1] // rb[1]), device=x.device))
    else:
        data, scale = _cast(x, fp8_dtype, rb, margin=margin, power_of_two=power_of_two)
    if rb is None:
        scale = scale.reshape(())
    q = Fp8Tensor(data=data.contiguous(), scale=scale, block=rb)
    if raise_on_nonfinite and bool(q.nonfinite):  # host sync, by request
        raise NumericsError(f"{name} of shape {tuple(x.shape)} contains inf or NaN before FP8 "
                            "quantization; find the producing layer with mixprec.monitor, or lower "
                            "the learning rate / loss scale")
    return q


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
