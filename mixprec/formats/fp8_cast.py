"""FP8 casts built for speed: amax, scale and the saturated cast in as few passes as the math needs.

One function per granularity, each returning ``(data, scale)`` for a 2-D tensor ``x`` (R, C):

=====================  ===========================  ====================================
function               one scale per                ``scale`` shape (the block grid)
=====================  ===========================  ====================================
``cast_tensorwise``    the tensor                   ``(1, 1)``
``cast_rowwise``       row (``dim=1``) / column     ``(R, 1)`` / ``(1, C)``
``cast_1x128``         1x128 tile along ``dim``     ``(R, ceil(C/128))`` / ``(ceil(R/128), C)``
``cast_128x128``       128x128 block                ``(ceil(R/128), ceil(C/128))``
=====================  ===========================  ====================================

``dim`` is the dimension the scale groups run along (the GEMM's contraction dimension). Casting
along ``dim=0`` gives the operand the *transpose* needs (``data.t()``, ``scale.t()``) without
materialising a high-precision transpose. ``scale`` is the dequantization factor
(``x ~= data * scale`` block by block), ``amax * 2**margin / fp8_max``, as ``torch._scaled_mm``
takes it.

Why each pass is there (an eager GPU pays a launch per op; ``torch.compile`` fuses them all):

* the amax is ``linalg.vector_norm(ord=inf)`` in the *input* dtype: one read of ``x``, no ``abs``
  copy, no FP32 copy of a BF16 tensor (the max of |x| is exact in any dtype); it is NaN/inf when
  the block holds NaN/inf;
* the scale math runs on the small amax tensor in FP32;
* the cast is one multiply (BF16 x FP32 scale promotes to FP32 element by element, no copy) and
  one conversion. There is no clamp: with the scale from the tensor's own amax, ``|x * inv|``
  exceeds the format's max by at most a rounding error, which the conversion rounds back to the
  max. (:func:`cast_with_amax`, used by delayed scaling, clamps: values above a *past* amax must
  saturate.)

Non-finite input is never saturated and never checked here with a host read: an inf/NaN makes
the block's amax, hence its scale, non-finite (inf or NaN), so everything computed from the block
is non-finite. When a ``flag`` tensor is passed, the cast folds its scales into it
(``flag = max(flag, max(scale))``, NaN-sticky) so a training step can read one device tensor
later (see :mod:`mixprec.formats.fp8_nonfinite`). No Python branch on tensor values, no logging,
no hardware query: every function here traces into one ``torch.compile`` graph.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["EPS", "cast_tensorwise", "cast_rowwise", "cast_1x128", "cast_128x128", "cast_with_amax",
           "scale_and_inverse", "tensor_amax", "BLOCK"]

EPS = 1e-12
"""Floor for an amax (all-zero tiles), as in common FP8 training libraries."""
BLOCK = 128
"""DeepSeek-V3's tile / block edge."""
_INF = float("inf")


def scale_and_inverse(amax: torch.Tensor, fp8_dtype: torch.dtype, *, margin: int = 0,
                      power_of_two: bool = False,
                      flag: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantization scale ``amax * 2**margin / fp8_max`` (FP32, amax floored at ``EPS``) and
    its reciprocal, the quantizing multiplier. ``power_of_two`` rounds the scale *up* to a power
    of two (so the multiplier rounds down and nothing overflows). A non-finite amax gives a
    non-finite scale. ``flag`` (FP32, any shape) is updated in place to ``max(flag, max(scale))``."""
    k = 2.0 ** margin / torch.finfo(fp8_dtype).max
    scale = amax.float().mul(k).clamp_min_(EPS * k)      # NaN stays NaN, inf stays inf
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    if flag is not None:
        torch.maximum(flag, scale if scale.numel() == 1 else scale.amax(), out=flag)
    return scale, scale.reciprocal()


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad ``x`` so its dims are multiples of ``rows`` / ``cols`` (a no-op when they are);
    a zero never raises a tile's amax, so the ragged tile's scale comes from its real elements."""
    pr, pc = -x.shape[0] % rows, -x.shape[1] % cols
    return F.pad(x, (0, pc, 0, pr)) if pr or pc else x


def _finish(q: torch.Tensor, padded: torch.Size, shape: torch.Size) -> torch.Tensor:
    """Blocked FP8 view -> (R, C), dropping the padding of a ragged last tile (a view)."""
    q = q.view(padded)
    return q if padded == shape else q[: shape[0], : shape[1]]


def cast_tensorwise(x: torch.Tensor, fp8_dtype: torch.dtype, *, margin: int = 0,
                    power_of_two: bool = False,
                    flag: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole 2-D ``x``: ``(data, scale (1, 1))``."""
    amax = torch.linalg.vector_norm(x, _INF, dim=(0, 1), keepdim=True)
    scale, inv = scale_and_inverse(amax, fp8_dtype, margin=margin, power_of_two=power_of_two,
                                   flag=flag)
    return (x * inv).to(fp8_dtype), scale


def cast_rowwise(x: torch.Tensor, fp8_dtype: torch.dtype, *, dim: int = 1, margin: int = 0,
                 power_of_two: bool = False,
                 flag: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row (``dim=1``: groups run along the columns) or per column (``dim=0``)."""
    amax = torch.linalg.vector_norm(x, _INF, dim=dim, keepdim=True)
    scale, inv = scale_and_inverse(amax, fp8_dtype, margin=margin, power_of_two=power_of_two,
                                   flag=flag)
    return (x * inv).to(fp8_dtype), scale


def cast_1x128(x: torch.Tensor, fp8_dtype: torch.dtype, *, dim: int = 1, tile: int = BLOCK,
               margin: int = 0, power_of_two: bool = False,
               flag: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per ``1 x tile`` run along ``dim`` (``dim=1``: DeepSeek-V3's activation tiles;
    ``dim=0``: the tiles of ``x.t()``, computed without transposing ``x``)."""
    R, C = x.shape
    if dim == 1:
        p = _pad_to(x, 1, tile)
        v = p.view(R, p.shape[1] // tile, tile)                       # (R, nk, tile)
        amax = torch.linalg.vector_norm(v, _INF, dim=2, keepdim=True)
    else:
        p = _pad_to(x, tile, 1)
        v = p.view(p.shape[0] // tile, tile, C)                       # (mb, tile, C)
        amax = torch.linalg.vector_norm(v, _INF, dim=1, keepdim=True)
    scale, inv = scale_and_inverse(amax, fp8_dtype, margin=margin, power_of_two=power_of_two,
                                   flag=flag)
    data = _finish((v * inv).to(fp8_dtype), p.shape, x.shape)
    return data, (scale.squeeze(2) if dim == 1 else scale.squeeze(1))


def cast_128x128(x: torch.Tensor, fp8_dtype: torch.dtype, *, block: tuple[int, int] = (BLOCK, BLOCK),
                 margin: int = 0, power_of_two: bool = False,
                 flag: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per ``block`` (DeepSeek-V3's 128x128 weight blocks). Square blocks make the same
    scales (transposed) valid for ``x.t()``: ``(data.t(), scale.t())``."""
    br, bc = block
    v = _pad_to(x, br, bc)
    Rp, Cp = v.shape
    v = v.view(Rp // br, br, Cp // bc, bc)
    amax = torch.linalg.vector_norm(v, _INF, dim=(1, 3), keepdim=True)   # (Rb, 1, Cb, 1)
    scale, inv = scale_and_inverse(amax, fp8_dtype, margin=margin, power_of_two=power_of_two,
                                   flag=flag)
    data = _finish((v * inv).to(fp8_dtype), torch.Size((Rp, Cp)), x.shape)
    return data, scale.view(Rp // br, Cp // bc)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` of a 2-D tensor as FP32 ``(1, 1)``, NaN/inf when ``x`` holds NaN/inf."""
    return torch.linalg.vector_norm(x, _INF, dim=(0, 1), keepdim=True).float()


def cast_with_amax(x: torch.Tensor, fp8_dtype: torch.dtype, amax: torch.Tensor, *, margin: int = 0,
                   power_of_two: bool = False, own_amax: torch.Tensor | None = None,
                   flag: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensorwise cast from a given (delayed, historical) ``amax``: values above it saturate at
    the format's max, which is what delayed scaling means. A non-finite ``x`` still poisons the
    scale: its own amax (``own_amax`` when the caller has it, e.g. for an amax history) is used
    where it is not finite."""
    own = tensor_amax(x) if own_amax is None else own_amax
    amax = torch.where(torch.isfinite(own), amax.reshape(1, 1).float(), own)
    scale, inv = scale_and_inverse(amax, fp8_dtype, margin=margin, power_of_two=power_of_two,
                                   flag=flag)
    fmax = torch.finfo(fp8_dtype).max
    return (x * inv).clamp_(-fmax, fmax).to(fp8_dtype), scale
