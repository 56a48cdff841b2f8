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
* the scale math runs on the small amax tensors in FP32; :func:`cast_group` does it for several
  operands at once with ``torch._foreach_*`` ops (one launch per step of the math, not one per
  operand);
* the cast is one multiply by the scale's reciprocal (a division for power-of-two scales, where
  it is exact and saves the reciprocal) -- BF16 x FP32 promotes to FP32 element by element, no
  copy -- and one conversion. There is no clamp: with the scale from the tensor's own amax,
  ``|x / scale|`` exceeds the format's max by at most a rounding error, which the conversion
  rounds back to the max. (:func:`cast_with_amax`, used by delayed scaling, clamps: values above
  a *past* amax must saturate.) The bytes and scales are those mixprec computed before #36.

Non-finite input is never saturated and never checked here with a host read: an inf/NaN makes
the block's amax, hence its scale, non-finite (inf or NaN), so everything computed from the block
is non-finite. When a ``flag`` tensor is passed, the cast folds its scales into it
(``flag = max(flag, max(scale))``, NaN-sticky; once per source tensor in a group) so a training step can read one device tensor
later (see :mod:`mixprec.formats.fp8_nonfinite`). No Python branch on tensor values, no logging,
no hardware query: every function here traces into one ``torch.compile`` graph.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["EPS", "BLOCK", "cast_tensorwise", "cast_rowwise", "cast_1x128", "cast_128x128",
           "cast_group", "cast_with_amax", "compute_scales", "tensor_amax", "fold_flag"]

EPS = 1e-12
"""Floor for an amax (all-zero tiles), as in common FP8 training libraries."""
BLOCK = 128
"""DeepSeek-V3's tile / block edge."""
_INF = float("inf")

GRANULARITIES = ("tensor", "row", "tile", "block")
"""One scale per tensor; per row along ``dim``; per 1 x ``block[1]`` tile along ``dim``; per
``block`` (2-D)."""

_K_TENSORS: dict[tuple[str, float], torch.Tensor] = {}


def _k_tensor(k: float, device: torch.device) -> torch.Tensor:
    """A cached FP32 (1, 1) constant: multiplying a BF16 amax by it gives FP32 (type promotion),
    so one ``_foreach_mul`` both converts and scales."""
    key = (str(device), k)
    t = _K_TENSORS.get(key)
    if t is None:
        t = _K_TENSORS[key] = torch.full((1, 1), k, dtype=torch.float32, device=device)
    return t


def compute_scales(amaxes: list[torch.Tensor], fp8_dtype: torch.dtype, *, margin: int = 0,
                   power_of_two: bool = False) -> list[torch.Tensor]:
    """Dequantization scales ``amax * 2**margin / fp8_max`` (FP32, amax floored at ``EPS``), one per
    amax tensor, shapes kept. ``power_of_two`` rounds each scale *up* to a power of two (so the
    quantized values round down and nothing overflows). A non-finite amax gives a non-finite
    scale. Several amaxes share each op (``torch._foreach_*``)."""
    k = 2.0 ** margin / torch.finfo(fp8_dtype).max
    if len(amaxes) == 1:
        s = amaxes[0].float().mul(k).clamp_min_(EPS * k)        # NaN stays NaN, inf stays inf
        return [torch.exp2(torch.ceil(torch.log2(s)))] if power_of_two else [s]
    if all(a.dtype == torch.float32 for a in amaxes):
        s = torch._foreach_mul(amaxes, k)
    else:
        s = torch._foreach_mul(amaxes, [_k_tensor(k, a.device) for a in amaxes])
    torch._foreach_clamp_min_(s, EPS * k)
    if power_of_two:
        s = torch._foreach_log2(s)
        torch._foreach_ceil_(s)
        s = torch._foreach_pow(2.0, s)
    return list(s)


def fold_flag(flag: torch.Tensor, scale: torch.Tensor) -> None:
    """``flag = max(flag, max(scale))`` in place: NaN-sticky, inf-sticky, no host read."""
    torch.maximum(flag, scale if scale.shape == flag.shape else scale.amax(), out=flag)


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad ``x`` so its dims are multiples of ``rows`` / ``cols`` (a no-op when they are);
    a zero never raises a tile's amax, so the ragged tile's scale comes from its real elements."""
    pr, pc = -x.shape[0] % rows, -x.shape[1] % cols
    return F.pad(x, (0, pc, 0, pr)) if pr or pc else x


def _blocked(x: torch.Tensor, gran: str, dim: int, block: tuple[int, int]):
    """``x`` viewed so one reduction gives the amax per scale group: (view, reduced dims, padded)."""
    if gran == "tensor":
        return x, (0, 1), x
    if gran == "row":
        return x, (dim,), x
    R, C = x.shape
    if gran == "tile":
        tile = block[1]
        if dim == 1:
            p = _pad_to(x, 1, tile)
            return p.view(R, p.shape[1] // tile, tile), (2,), p          # (R, nk, tile)
        p = _pad_to(x, tile, 1)
        return p.view(p.shape[0] // tile, tile, C), (1,), p              # (mb, tile, C)
    br, bc = block
    p = _pad_to(x, br, bc)
    return p.view(p.shape[0] // br, br, p.shape[1] // bc, bc), (1, 3), p  # (Rb, br, Cb, bc)


def _grid(scale: torch.Tensor, gran: str, dim: int) -> torch.Tensor:
    """Keep-dim amax/scale shape -> the block grid ``Fp8Tensor.scale`` holds."""
    if gran in ("tensor", "row"):
        return scale
    if gran == "tile":
        return scale.squeeze(2) if dim == 1 else scale.squeeze(1)
    return scale.view(scale.shape[0], scale.shape[2])


def cast_group(tensors: list[torch.Tensor], specs: tuple[tuple[str, int, tuple[int, int]], ...],
               fp8_dtype: torch.dtype, *, margin: int = 0, power_of_two: bool = False,
               flag: torch.Tensor | None = None,
               flag_from: tuple[int, ...] = ()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cast several tensors to one FP8 dtype, each by its ``(granularity, dim, block)`` spec;
    their scale math shares ops. ``flag_from``: indices whose scales are folded into ``flag``
    (one per source tensor is enough: a non-finite element poisons every grouping of it).
    Returns ``(data, scale)`` per tensor: data in the tensor's own layout, scale its block grid."""
    views, amaxes = [], []
    for t, (gran, dim, block) in zip(tensors, specs):
        v, dims, p = _blocked(t, gran, dim, block)
        views.append((v, p))
        amaxes.append(torch.linalg.vector_norm(v, _INF, dim=dims, keepdim=True))
    scales = compute_scales(amaxes, fp8_dtype, margin=margin, power_of_two=power_of_two)
    if flag is not None:
        for i in flag_from:
            fold_flag(flag, scales[i])
    # Power-of-two scales: dividing is exact. Otherwise multiply by the reciprocal, as the
    # recipe's reference computes (and mixprec always has: the same bits as before #36).
    mults = scales if power_of_two else (
        [scales[0].reciprocal()] if len(scales) == 1 else list(torch._foreach_reciprocal(scales)))
    out = []
    for t, (v, p), s, m, (gran, dim, _) in zip(tensors, views, scales, mults, specs):
        q = (v / m if power_of_two else v * m).to(fp8_dtype)
        if q.dim() != 2:
            q = q.view(p.shape)
        if p.shape != t.shape:
            q = q[: t.shape[0], : t.shape[1]]
        out.append((q, _grid(s, gran, dim)))
    return out


def _one(x, gran, dim, block, fp8_dtype, margin, power_of_two, flag):
    return cast_group([x], ((gran, dim, block),), fp8_dtype, margin=margin,
                      power_of_two=power_of_two, flag=flag, flag_from=(0,))[0]


def cast_tensorwise(x: torch.Tensor, fp8_dtype: torch.dtype, *, margin: int = 0,
                    power_of_two: bool = False,
                    flag: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole 2-D ``x``: ``(data, scale (1, 1))``."""
    return _one(x, "tensor", 1, (1, 1), fp8_dtype, margin, power_of_two, flag)


def cast_rowwise(x: torch.Tensor, fp8_dtype: torch.dtype, *, dim: int = 1, margin: int = 0,
                 power_of_two: bool = False,
                 flag: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row (``dim=1``: groups run along the columns) or per column (``dim=0``)."""
    return _one(x, "row", dim, (1, 1), fp8_dtype, margin, power_of_two, flag)


def cast_1x128(x: torch.Tensor, fp8_dtype: torch.dtype, *, dim: int = 1, tile: int = BLOCK,
               margin: int = 0, power_of_two: bool = False,
               flag: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per ``1 x tile`` run along ``dim`` (``dim=1``: DeepSeek-V3's activation tiles;
    ``dim=0``: the tiles of ``x.t()``, computed without transposing ``x``)."""
    return _one(x, "tile", dim, (1, tile), fp8_dtype, margin, power_of_two, flag)


def cast_128x128(x: torch.Tensor, fp8_dtype: torch.dtype, *, block: tuple[int, int] = (BLOCK, BLOCK),
                 margin: int = 0, power_of_two: bool = False,
                 flag: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per ``block`` (DeepSeek-V3's 128x128 weight blocks). Square blocks make the same
    scales (transposed) valid for ``x.t()``: ``(data.t(), scale.t())``."""
    return _one(x, "block", 1, block, fp8_dtype, margin, power_of_two, flag)


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
    amax = amax.reshape(1, 1).float() + (own - own)    # own - own: 0, or NaN for an inf/NaN x
    (scale,) = compute_scales([amax], fp8_dtype, margin=margin, power_of_two=power_of_two)
    if flag is not None:
        fold_flag(flag, scale)
    fmax = torch.finfo(fp8_dtype).max
    q = x / scale if power_of_two else x * scale.reciprocal()
    return q.clamp_(-fmax, fmax).to(fp8_dtype), scale
