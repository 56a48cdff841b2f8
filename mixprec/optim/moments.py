"""8-bit storage of Adam's moments: block-wise INT8, or FP8 (E4M3 / E5M2) with per-block range expansion.

Adam keeps two FP32 numbers per parameter (8 bytes). mixprec's AdamW can store them in 8 bits
each (2 bytes per parameter), block by block (consecutive elements of the flattened parameter,
the last block padded; the block length is the format's ``Layout.block``), and always does the
arithmetic in FP32: a chunk of moments is decoded into FP32 scratch, updated, used, and encoded
again.

* ``int8``: the first moment ``m`` as signed codes ``round(m / s * 127)`` with ``s`` the block's
  absolute maximum. The second moment ``v`` spans many decades even inside a block, and a ``v``
  rounded to zero turns ``m / (sqrt(v) + eps)`` into a huge step; so ``sqrt(v)`` is stored (half
  the decades) as unsigned codes 1..255 of the block's maximum, *zero excluded*: a positive value
  below half a code is stored as the smallest code (its update is then smaller, never larger).
  Both are rounded **stochastically** (unbiased: ``m * beta1`` moves by less than a code, and
  round-to-nearest would freeze it).
* ``fp8`` (E4M3) and ``fp8-e5m2``: both moments in that FP8 format after COAT's dynamic range
  expansion (Xi et al., 2024): per block, ``x -> sign(x) * (|x| / max)^k * FMAX`` with ``k``
  chosen so the block's range ``max / min`` (non-zero magnitudes) fills the format's range
  (``FMAX / smallest subnormal``), then round to nearest. ``v`` is stored as ``sqrt(v)``, zero
  excluded as above. Two numbers per block (max, k).

**Scales are 16-bit** (BF16): the block maximum is rounded *up* to BF16 before the codes are made
against it (so no code overflows, and the decode uses the very scale the encode used), ``k`` is
rounded to BF16 before it is used. int8 blocks hold 1024 elements (one 2-byte scale: 0.002 bytes
per element), FP8 blocks 256 (two: 0.016). Bytes per parameter for both moments: int8 2.0039,
fp8 2.0313 (``state_bytes``); docs/lean.md has the fidelity measurement behind these choices.
Checkpoints of the earlier layout (FP32 scales, 256-element int8 blocks) are converted on load.
The state is per parameter (``exp_avg``, ``exp_avg_scale``, ...), so a checkpoint holds the 8-bit
codes and loads with ``weights_only=True``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["MOMENTS", "LAYOUTS", "Layout", "is_quantized", "new_state", "decode_", "encode_", "state_bytes",
           "upgrade_", "arithmetic"]

MOMENTS = ("fp32", "bf16", "int8", "fp8", "fp8-e5m2")
"""Storage formats of the moments (``fp32`` and ``bf16`` are plain tensors)."""
_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How one 8-bit format lays out a moment: code dtypes (m, v), block length, scale dtype and
    the number of scales per block (int8: the max; fp8: the max and the exponent k)."""

    codes: tuple[torch.dtype, torch.dtype]
    block: int
    scale_dtype: torch.dtype = torch.bfloat16
    scales: int = 1

    def blocks(self, n: int) -> int:
        return (n + self.block - 1) // self.block

    def bytes_per_param(self) -> float:
        """Both moments: one byte of code each plus the block scales."""
        item = torch.empty(0, dtype=self.scale_dtype).element_size()
        return 2.0 + 2 * self.scales * item / self.block


LAYOUTS: dict[str, Layout] = {
    "int8": Layout(codes=(torch.int8, torch.uint8), block=1024),
    "fp8": Layout(codes=(torch.float8_e4m3fn, torch.float8_e4m3fn), block=256, scales=2),
    "fp8-e5m2": Layout(codes=(torch.float8_e5m2, torch.float8_e5m2), block=256, scales=2),
}
_LEGACY: dict[str, Layout] = {      # before 16-bit scales: FP32 scales, 256-element blocks
    "int8": Layout(codes=(torch.int8, torch.uint8), block=256, scale_dtype=torch.float32),
    "fp8": Layout(codes=(torch.float8_e4m3fn, torch.float8_e4m3fn), block=256, scale_dtype=torch.float32, scales=2),
}


def _fp8_range(dtype: torch.dtype) -> tuple[float, float]:
    """(largest finite, smallest subnormal) of an FP8 dtype."""
    fi = torch.finfo(dtype)
    return float(fi.max), float(fi.smallest_normal) * float(fi.eps)     # eps = 2**-mantissa bits


def is_quantized(moments: str) -> bool:
    return moments in LAYOUTS


def state_bytes(moments: str) -> float:
    """Bytes per parameter of both moments (block scales included)."""
    if moments in LAYOUTS:
        return LAYOUTS[moments].bytes_per_param()
    return {"fp32": 8.0, "bf16": 4.0}[moments]


def arithmetic(moments: str) -> str:
    """How ``state_bytes(moments)`` adds up, in one line (for ``mixprec memory``)."""
    if moments not in LAYOUTS:
        b = state_bytes(moments) / 2
        return f"2 x {b:g} bytes = {2 * b:g} bytes per parameter"
    lay = LAYOUTS[moments]
    item = torch.empty(0, dtype=lay.scale_dtype).element_size()
    name = str(lay.scale_dtype).removeprefix("torch.")
    return (f"2 x (1-byte code + {lay.scales} x {item}-byte {name} scale / {lay.block} values) "
            f"= 2 x {1 + lay.scales * item / lay.block:.5f} = {lay.bytes_per_param():.4f} bytes per parameter")


def _scale_shape(lay: Layout, n: int) -> tuple[int, ...]:
    nb = lay.blocks(n)
    return (nb,) if lay.scales == 1 else (nb, lay.scales)


def new_state(p: Tensor, moments: str) -> dict[str, Tensor]:
    """Zero moments for ``p`` in the ``moments`` format (codes, and per-block scales)."""
    lay = LAYOUTS[moments]
    st: dict[str, Tensor] = {}
    for key, code in zip(_KEYS, lay.codes):
        st[key] = torch.zeros(p.shape, dtype=code, device=p.device)
        st[key + "_scale"] = torch.zeros(_scale_shape(lay, p.numel()), dtype=lay.scale_dtype, device=p.device)
    return st


def _offsets(tensors: list[Tensor], block: int) -> list[int]:
    """Start of each tensor in a buffer where every tensor begins on a block boundary."""
    out, at = [], 0
    for t in tensors:
        out.append(at)
        at += (t.numel() + block - 1) // block * block
    return out + [at]


def _pack(srcs: list[Tensor], block: int) -> Tensor:
    """One zero-padded FP32 buffer (blocks, block) holding every ``srcs`` tensor from a block
    boundary (one foreach copy)."""
    offs = _offsets(srcs, block)
    buf = torch.zeros(offs[-1], dtype=torch.float32, device=srcs[0].device)
    torch._foreach_copy_([buf[a:a + t.numel()] for a, t in zip(offs, srcs)], [t.reshape(-1) for t in srcs])
    return buf.view(-1, block)


def _views(buf: Tensor, like: list[Tensor], block: int) -> list[Tensor]:
    flat = buf.view(-1)
    return [flat[a:a + t.numel()] for a, t in zip(_offsets(like, block), like)]


def _round_up_bf16(x: Tensor) -> Tensor:
    """Non-negative finite FP32 ``x`` rounded up to the next BF16 value (exactly representable)."""
    bits = x.contiguous().view(torch.int32) + 0xFFFF
    return bits.bitwise_and_(-65536).view(torch.float32)


def _store_scale(x: Tensor, lay: Layout, up: bool) -> Tensor:
    """The FP32 value of ``x`` as the layout's scale dtype stores it (BF16: rounded up when ``up``)."""
    if lay.scale_dtype == torch.float32:
        return x
    return _round_up_bf16(x) if up else x.to(lay.scale_dtype).float()


@torch.no_grad()
def decode_(states: list[dict[str, Tensor]], key: str, outs: list[Tensor], moments: str,
            layout: Layout | None = None) -> None:
    """Write the FP32 values of moment ``key`` of every state into ``outs`` (FP32, the params'
    shapes): one set of vectorised ops for the whole list."""
    lay = layout or LAYOUTS[moments]
    q = _pack([st[key] for st in states], lay.block)
    scale = torch.cat([st[key + "_scale"] for st in states]).float()
    if moments == "int8":
        top = 127.0 if key == "exp_avg" else 255.0
        vals = q.mul_((scale / top).unsqueeze(1))
    else:
        fmax, _ = _fp8_range(lay.codes[0])
        y = q.div_(fmax)                                                # sign * (|x|/max)^k
        mx, k = scale[:, 0:1], scale[:, 1:2]
        vals = y.abs().pow_(1.0 / k.clamp_min(1e-6)).mul_(mx).mul_(y.sign())
    if key == "exp_avg_sq":
        vals.square_()
    torch._foreach_copy_([o.view(-1) for o in outs], _views(vals, outs, lay.block))


@torch.no_grad()
def encode_(states: list[dict[str, Tensor]], key: str, xs: list[Tensor], moments: str,
            generator: torch.Generator | None) -> None:
    """Store FP32 ``xs`` as moment ``key`` of each state (stochastic rounding for int8, nearest
    for fp8); the rounding noise is drawn once for the whole list."""
    lay = LAYOUTS[moments]
    vals = _pack(xs, lay.block)
    if key == "exp_avg_sq":
        vals = vals.clamp_min_(0).sqrt_()
    codes = [st[key] for st in states]
    if moments == "int8":
        signed = key == "exp_avg"
        mx = _store_scale(vals.abs().amax(dim=1), lay, up=True)         # (blocks,), >= every |x|
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
        fmax, fmin = _fp8_range(lay.codes[0])
        mag = vals.abs()
        mx = _store_scale(mag.amax(dim=1, keepdim=True), lay, up=True)
        mn = torch.where(mag > 0, mag, torch.full_like(mag, float("inf"))).amin(dim=1, keepdim=True)
        ratio = torch.where((mx > 0) & torch.isfinite(mn), mx / mn, torch.ones_like(mx)).clamp_min(1.0 + 1e-6)
        k = (math.log(fmax / fmin) / ratio.log()).clamp(0.25, 8.0)     # expand (k > 1) or compress
        k = _store_scale(k, lay, up=False)
        safe = torch.where(mx > 0, mx, torch.ones_like(mx))
        y = (mag / safe).pow_(k).mul_(fmax)
        if key == "exp_avg_sq":
            y = torch.where(mag > 0, y.clamp_min(fmin), y)                           # zero excluded
        q = y.mul_(vals.sign())
        new_scales = torch.cat([mx, k], dim=1)
    torch._foreach_copy_([c.view(-1) for c in codes], _views(q, codes, lay.block))   # casts to the code dtype
    splits = [st[key + "_scale"].shape[0] for st in states]
    torch._foreach_copy_([st[key + "_scale"] for st in states], list(new_scales.split(splits)))


@torch.no_grad()
def upgrade_(st: dict[str, Tensor], moments: str, generator: torch.Generator | None) -> bool:
    """Convert one parameter's state saved in the earlier layout (FP32 scales, ``_LEGACY``) to
    today's, in place; False when it already is today's layout."""
    old = _LEGACY.get(moments)
    if old is None or st["exp_avg_scale"].dtype != old.scale_dtype:
        return False
    for key in _KEYS:
        code = st[key]
        wide = torch.empty(code.shape, dtype=torch.float32, device=code.device)
        decode_([st], key, [wide], moments, layout=old)
        fresh = new_state(code, moments)
        st[key], st[key + "_scale"] = fresh[key], fresh[key + "_scale"]
        encode_([st], key, [wide], moments, generator)
    return True
