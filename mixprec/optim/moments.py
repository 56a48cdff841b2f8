"""8-bit storage of Adam's moments: block-wise INT8, or FP8 E4M3 with per-block range expansion.

Adam keeps two FP32 numbers per parameter (8 bytes). mixprec's AdamW can store them in 8 bits
each (2 bytes per parameter), block by block (``BLOCK`` = 256 consecutive elements of the
flattened parameter, the last block padded), and always does the arithmetic in FP32: a chunk of
moments is decoded into FP32 scratch, updated, used, and encoded again.

* ``int8``: the first moment ``m`` as signed codes ``round(m / s * 127)`` with ``s`` the block's
  absolute maximum (an FP32 scale per block). The second moment ``v`` spans many decades even
  inside a block, and a ``v`` rounded to zero turns ``m / (sqrt(v) + eps)`` into a huge step; so
  ``sqrt(v)`` is stored (half the decades) as unsigned codes 1..255 of the block's maximum, *zero
  excluded*: a positive value below half a code is stored as the smallest code (its update is
  then smaller, never larger). Both are rounded **stochastically** (unbiased: ``m * beta1`` moves
  by less than a code, and round-to-nearest would freeze it).
* ``fp8``: both moments in ``float8_e4m3fn`` after COAT's dynamic range expansion (Xi et al.,
  2024): per block, ``x -> sign(x) * (|x| / max)^k * 448`` with ``k`` chosen so the block's range
  ``max / min`` (non-zero magnitudes) fills E4M3's range (448 / 2**-9), then round to nearest.
  ``v`` is stored as ``sqrt(v)``, zero excluded as above. Two FP32 numbers per block (max, k).

Per 256-element block the scales cost 4 (int8) or 8 (fp8) bytes per moment: 2.03 / 2.06 bytes
per parameter for both moments. The state is per parameter (``exp_avg``, ``exp_avg_scale``, ...),
so a checkpoint holds the 8-bit codes and loads with ``weights_only=True``.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["MOMENTS", "BLOCK", "is_quantized", "new_state", "decode_", "encode_", "state_bytes"]

MOMENTS = ("fp32", "bf16", "int8", "fp8")
"""Storage formats of the moments (``fp32`` and ``bf16`` are plain tensors)."""
BLOCK = 256
_E4M3_MAX = 448.0
_E4M3_MIN = 2.0 ** -9                      # smallest subnormal
_LOG_RANGE = math.log(_E4M3_MAX / _E4M3_MIN)
_KEYS = ("exp_avg", "exp_avg_sq")


def is_quantized(moments: str) -> bool:
    return moments in ("int8", "fp8")


def state_bytes(moments: str) -> float:
    """Bytes per parameter of both moments (block scales included)."""
    return {"fp32": 8.0, "bf16": 4.0, "int8": 2.0 + 2 * 4 / BLOCK, "fp8": 2.0 + 2 * 8 / BLOCK}[moments]


def _blocks(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


def new_state(p: Tensor, moments: str) -> dict[str, Tensor]:
    """Zero moments for ``p`` in the ``moments`` format (codes, and per-block scales)."""
    nb = _blocks(p.numel())
    st: dict[str, Tensor] = {}
    for key, signed in zip(_KEYS, (True, False)):
        if moments == "int8":
            st[key] = torch.zeros(p.shape, dtype=torch.int8 if signed else torch.uint8, device=p.device)
            st[key + "_scale"] = torch.zeros(nb, dtype=torch.float32, device=p.device)
        else:
            st[key] = torch.zeros(p.shape, dtype=torch.float8_e4m3fn, device=p.device)
            st[key + "_scale"] = torch.zeros(nb, 2, dtype=torch.float32, device=p.device)   # (max, k)
    return st


def _offsets(tensors: list[Tensor]) -> list[int]:
    """Start of each tensor in a buffer where every tensor begins on a block boundary."""
    out, at = [], 0
    for t in tensors:
        out.append(at)
        at += _blocks(t.numel()) * BLOCK
    return out + [at]


def _pack(srcs: list[Tensor], dtype: torch.dtype) -> tuple[Tensor, list[Tensor]]:
    """One zero-padded buffer (blocks, BLOCK) in ``dtype`` holding every ``srcs`` tensor from a block
    boundary, and the views of it that hold each tensor (one foreach copy)."""
    offs = _offsets(srcs)
    buf = torch.zeros(offs[-1], dtype=dtype, device=srcs[0].device)
    views = [buf[a:a + t.numel()] for a, t in zip(offs, srcs)]
    torch._foreach_copy_(views, [t.reshape(-1) for t in srcs])
    return buf.view(-1, BLOCK), views


def _views(buf: Tensor, like: list[Tensor]) -> list[Tensor]:
    offs = _offsets(like)
    flat = buf.view(-1)
    return [flat[a:a + t.numel()] for a, t in zip(offs, like)]


@torch.no_grad()
def decode_(states: list[dict[str, Tensor]], key: str, outs: list[Tensor], moments: str) -> None:
    """Write the FP32 values of moment ``key`` of every state into ``outs`` (FP32, the params'
    shapes): one set of vectorised ops for the whole list."""
    q, _ = _pack([st[key] for st in states], torch.float32)
    scale = torch.cat([st[key + "_scale"] for st in states])
    if moments == "int8":
        top = 127.0 if key == "exp_avg" else 255.0
        vals = q.mul_((scale / top).unsqueeze(1))
        if key == "exp_avg_sq":
            vals.square_()
    else:
        y = q.div_(_E4M3_MAX)                                           # sign * (|x|/max)^k
        mx, k = scale[:, 0:1], scale[:, 1:2]
        vals = y.abs().pow_(1.0 / k.clamp_min(1e-6)).mul_(mx).mul_(y.sign())
        if key == "exp_avg_sq":
            vals.square_()
    torch._foreach_copy_([o.view(-1) for o in outs], _views(vals, outs))


@torch.no_grad()
def encode_(states: list[dict[str, Tensor]], key: str, xs: list[Tensor], moments: str,
            generator: torch.Generator | None) -> None:
    """Store FP32 ``xs`` as moment ``key`` of each state (stochastic rounding for int8, nearest
    for fp8); the rounding noise is drawn once for the whole list."""
    vals, _ = _pack(xs, torch.float32)
    if key == "exp_avg_sq":
        vals = vals.clamp_min_(0).sqrt_()
    codes = [st[key] for st in states]
    if moments == "int8":
        signed = key == "exp_avg"
        mx = vals.abs().amax(dim=1)                                     # (blocks,)
        top = 127.0 if signed else 255.0
        safe = torch.where(mx > 0, mx, torch.ones_like(mx))
        q = vals / (safe / top).unsqueeze(1)
        q.add_(torch.rand(q.shape, generator=generator, device=q.device)).floor_()   # unbiased
        if signed:
            q.clamp_(-127, 127)
        else:
            q = torch.where(vals > 0, q.clamp(1, 255), torch.zeros_like(q))          # zero excluded
        new_scales = mx
    else:
        mag = vals.abs()
        mx = mag.amax(dim=1, keepdim=True)
        mn = torch.where(mag > 0, mag, torch.full_like(mag, float("inf"))).amin(dim=1, keepdim=True)
        ratio = torch.where((mx > 0) & torch.isfinite(mn), mx / mn, torch.ones_like(mx)).clamp_min(1.0 + 1e-6)
        k = (_LOG_RANGE / ratio.log()).clamp(0.25, 8.0)                 # expand (k > 1) or compress
        safe = torch.where(mx > 0, mx, torch.ones_like(mx))
        y = (mag / safe).pow_(k).mul_(_E4M3_MAX)
        if key == "exp_avg_sq":
            y = torch.where(mag > 0, y.clamp_min(_E4M3_MIN), y)                      # zero excluded
        q = y.mul_(vals.sign())
        new_scales = torch.cat([mx, k], dim=1)
    torch._foreach_copy_([c.view(-1) for c in codes], _views(q, codes))   # casts to the code dtype
    splits = [st[key + "_scale"].shape[0] for st in states]
    torch._foreach_copy_([st[key + "_scale"] for st in states], list(new_scales.split(splits)))
