"""8-bit storage of Adam's moments: block-wise INT8, or FP8 (E4M3 / E5M2) with per-block range expansion.

Adam keeps two FP32 numbers per parameter (8 bytes). mixprec's AdamW can store them in 8 bits
each (2 bytes per parameter), block by block, and always does the arithmetic in FP32: a chunk of
moments is decoded into FP32 scratch, updated, used, and encoded again.

**Blocks stay inside rows.** A matrix (or more: dim 0 is the row index, the rest one row) is cut
row by row into blocks of the format's ``Layout.block`` values, the last block of a row padded;
a row shorter than the block is one block. The scales are a ``(rows, blocks per row)`` tensor.
FSDP2 shards a parameter along dim 0 into whole rows, so the codes and the scales shard, gather
and reshard exactly like the parameter: a checkpoint saved at one world size loads at another bit
for bit (mixprec.optim.adamw keeps them as DTensors of the parameter's placement). Vectors
(biases, norm weights) and matrices with rows under ``MIN_ROW`` values keep FP32 moments
(:func:`quantizes`): their blocks would cross shard boundaries, and they are a sliver of a model.

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
fp8 2.0313 (``state_bytes``) for rows of a multiple of the block; int8 on rows of 512 values (one
scale per 512) 2.0078; docs/lean.md has the fidelity measurement behind these choices.
Checkpoints of the earlier layouts (FP32 scales, 256-element int8 blocks; blocks over the
flattened tensor) are converted on load.
The state is per parameter (``exp_avg``, ``exp_avg_scale``, ...), so a checkpoint holds the 8-bit
codes and loads with ``weights_only=True``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["MOMENTS", "LAYOUTS", "MIN_ROW", "Layout", "is_quantized", "quantizes", "new_state", "decode_",
           "encode_", "state_bytes", "upgrade_", "widen_", "to_bytes_", "from_bytes_", "arithmetic"]

MOMENTS = ("fp32", "bf16", "int8", "fp8", "fp8-e5m2")
"""Storage formats of the moments (``fp32`` and ``bf16`` are plain tensors)."""
_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How one 8-bit format lays out a moment: code dtypes (m, v), block length, scale dtype, the
    number of scales per block (int8: the max; fp8: the max and the exponent k), and whether the
    blocks stay inside rows (today's layout) or run over the flattened tensor (the earlier one)."""

    codes: tuple[torch.dtype, torch.dtype]
    block: int
    scale_dtype: torch.dtype = torch.bfloat16
    scales: int = 1
    rows: bool = True

    def blocks(self, n: int) -> int:
        return (n + self.block - 1) // self.block

    def bytes_per_param(self, row: int | None = None) -> float:
        """Both moments: one byte of code each plus the block scales, for rows of ``row`` values
        (``None``: rows a multiple of the block, the least)."""
        item = torch.empty(0, dtype=self.scale_dtype).element_size()
        per_row = 1 if row is None else (row + self.block - 1) // self.block
        span = self.block if row is None else row / per_row
        return 2.0 + 2 * self.scales * item / span


LAYOUTS: dict[str, Layout] = {
    "int8": Layout(codes=(torch.int8, torch.uint8), block=1024),
    "fp8": Layout(codes=(torch.float8_e4m3fn, torch.float8_e4m3fn), block=256, scales=2),
    "fp8-e5m2": Layout(codes=(torch.float8_e5m2, torch.float8_e5m2), block=256, scales=2),
}
_FLAT: dict[str, Layout] = {        # before blocks stayed inside rows: blocks of the flattened tensor
    name: Layout(codes=lay.codes, block=lay.block, scales=lay.scales, rows=False) for name, lay in LAYOUTS.items()
}
_LEGACY: dict[str, Layout] = {      # before 16-bit scales: FP32 scales, 256-element blocks, flat
    "int8": Layout(codes=(torch.int8, torch.uint8), block=256, scale_dtype=torch.float32, rows=False),
    "fp8": Layout(codes=(torch.float8_e4m3fn, torch.float8_e4m3fn), block=256, scale_dtype=torch.float32, scales=2,
                  rows=False),
}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
MIN_ROW = 16
"""A parameter's moments are stored in 8 bits when it has two or more dimensions and rows (dim 0
is the row index) of at least this many values (:func:`quantizes`); others (biases, norm weights)
keep FP32 moments: a vector's blocks would cross FSDP2's dim-0 shard boundaries."""


def _fp8_range(dtype: torch.dtype) -> tuple[float, float]:
    """(largest finite, smallest subnormal) of an FP8 dtype."""
    fi = torch.finfo(dtype)
    return float(fi.max), float(fi.smallest_normal) * float(fi.eps)     # eps = 2**-mantissa bits


def is_quantized(moments: str) -> bool:
    return moments in LAYOUTS


def quantizes(shape: tuple[int, ...] | torch.Size, moments: str) -> bool:
    """Whether a parameter of ``shape`` keeps ``moments`` in 8 bits (the one place that says it):
    matrices (or more) with rows of at least ``MIN_ROW`` values; vectors keep FP32 moments."""
    return is_quantized(moments) and len(shape) >= 2 and _rows(tuple(shape))[1] >= MIN_ROW


def state_bytes(moments: str, row: int | None = None) -> float:
    """Bytes per parameter of both moments (block scales included) of a matrix with rows of
    ``row`` values (``None``: a multiple of the block); vectors keep FP32 moments (8 bytes)."""
    if moments in LAYOUTS:
        return LAYOUTS[moments].bytes_per_param(row)
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
            f"= 2 x {1 + lay.scales * item / lay.block:.5f} = {lay.bytes_per_param():.4f} bytes per parameter "
            f"(blocks inside rows: a row of r < {lay.block} values is one block; vectors keep FP32 moments)")


def _rows(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, values per row) of a moment of ``shape``: dim 0 and the rest for a matrix (or more),
    one row for a vector."""
    if len(shape) >= 2:
        return shape[0], math.prod(shape[1:])
    return 1, math.prod(shape)


def _row_blocks(lay: Layout, shape: tuple[int, ...]) -> tuple[int, int]:
    """(blocks per row, block length): blocks never cross a row, so a dim-0 shard of the
    parameter (FSDP2's) holds whole blocks; a row shorter than the block is one block."""
    _, r = _rows(shape)
    if not lay.rows:
        return 0, lay.block
    b = max(1, min(lay.block, r))
    return (r + b - 1) // b, b


def _scale_shape(lay: Layout, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Scales of a moment of ``shape``: ``(rows, blocks per row)`` for a matrix (sharded along dim
    0 exactly like the parameter), ``(blocks,)`` for a vector; a trailing 2 for FP8 (max, k)."""
    tail = () if lay.scales == 1 else (lay.scales,)
    if not lay.rows:
        return (lay.blocks(math.prod(shape)),) + tail
    nbr, _ = _row_blocks(lay, shape)
    return ((shape[0], nbr) if len(shape) >= 2 else (nbr,)) + tail


def new_state(p: Tensor, moments: str) -> dict[str, Tensor]:
    """Zero moments for ``p`` in the ``moments`` format (codes, and per-block scales); ``p`` is a
    plain tensor (under FSDP2 the caller passes the local shard)."""
    lay = LAYOUTS[moments]
    st: dict[str, Tensor] = {}
    for key, code in zip(_KEYS, lay.codes):
        st[key] = torch.zeros(p.shape, dtype=code, device=p.device)
        st[key + "_scale"] = torch.zeros(_scale_shape(lay, tuple(p.shape)), dtype=lay.scale_dtype, device=p.device)
    return st


def _offsets(tensors: list[Tensor], block: int) -> list[int]:
    """Start of each tensor in a buffer where every tensor begins on a block boundary."""
    out, at = [], 0
    for t in tensors:
        out.append(at)
        at += (t.numel() + block - 1) // block * block
    return out + [at]


def _slots(tensors: list[Tensor], lay: Layout) -> tuple[int, list[tuple[int, int, int, int]]]:
    """Where each tensor goes in a zero-padded ``(blocks, block)`` buffer: (total blocks, and per
    tensor (first block, rows, blocks per row, values per row)). Flat layouts: one row."""
    out, at, block = [], 0, None
    for t in tensors:
        nbr, b = _row_blocks(lay, tuple(t.shape))
        rows, r = _rows(tuple(t.shape))
        if not lay.rows:
            rows, r, nbr = 1, t.numel(), lay.blocks(t.numel())
        if block is not None and b != block:
            raise ValueError("one buffer holds one block length")
        block = b
        out.append((at, rows, nbr, r))
        at += rows * nbr
    return at, out


def _groups(tensors: list[Tensor], lay: Layout) -> list[list[int]]:
    """Indices of ``tensors`` grouped by block length (rows shorter than the block are blocks of
    their own length), in first-seen order: each group is packed into one buffer."""
    by: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        by.setdefault(_row_blocks(lay, tuple(t.shape))[1], []).append(i)
    return list(by.values())


def _pack(srcs: list[Tensor], lay: Layout) -> Tensor:
    """One zero-padded FP32 buffer ``(blocks, block)`` holding every ``srcs`` tensor, each row
    starting on a block boundary (one foreach copy); all ``srcs`` share one block length."""
    total, slots = _slots(srcs, lay)
    block = _row_blocks(lay, tuple(srcs[0].shape))[1] if srcs else lay.block
    buf = torch.zeros(total, block, dtype=torch.float32, device=srcs[0].device)
    torch._foreach_copy_(_views(buf, srcs, lay), [t.reshape(s[1], s[3]) for t, s in zip(srcs, slots)])
    return buf


def _views(buf: Tensor, like: list[Tensor], lay: Layout) -> list[Tensor]:
    """Each tensor's ``(rows, values per row)`` window of a ``_pack`` buffer."""
    _, slots = _slots(like, lay)
    out = []
    for at, rows, nbr, r in slots:
        seg = buf[at:at + rows * nbr].view(rows, nbr * buf.shape[1])
        out.append(seg[:, :r])
    return out


def _round_up_bf16(x: Tensor) -> Tensor:
    """Non-negative finite FP32 ``x`` rounded up to the next BF16 value (exactly representable)."""
    bits = x.contiguous().view(torch.int32) + 0xFFFF
    return bits.bitwise_and_(-65536).view(torch.float32)


def _store_scale(x: Tensor, lay: Layout, up: bool) -> Tensor:
    """The FP32 value of ``x`` as the layout's scale dtype stores it (BF16: rounded up when ``up``)."""
    if lay.scale_dtype == torch.float32:
        return x
    return _round_up_bf16(x) if up else x.to(lay.scale_dtype).float()


def _flat_scales(states: list[dict[str, Tensor]], key: str, lay: Layout) -> Tensor:
    """The scales of every state, one row per block: ``(blocks,)`` or ``(blocks, 2)``."""
    tail = () if lay.scales == 1 else (lay.scales,)
    return torch.cat([st[key + "_scale"].reshape((-1,) + tail) for st in states]).float()


class _Packing:
    """Everything :func:`_decode` / :func:`_encode` need for one list of tensors of one block
    length, made once: the padded ``(blocks, block)`` FP32 buffer, each tensor's window of it, the
    tensors' ``(rows, values per row)`` views and the flat views of their scales. Kept in the
    ``cache`` a caller passes (the flat step's chunk, mixprec.optim.flat_chunk), so a step with a cache
    dispatches no per-tensor view op."""

    def __init__(self, codes: list[Tensor], others: list[Tensor], scales: list[Tensor], lay: Layout,
                 pool: dict | None = None) -> None:
        total, slots = _slots(codes, lay)
        block = _row_blocks(lay, tuple(codes[0].shape))[1]
        device = codes[0].device
        if pool is None:
            self.buf = torch.zeros(total, block, dtype=torch.float32, device=device)
        else:   # one buffer per device and block length, shared by every chunk (they run in turn)
            have = pool.get((device, block))
            if have is None or have.numel() < total * block:
                have = pool[(device, block)] = torch.zeros(max(total * block, 2 * (have.numel() if have is not None else 0)),
                                                           dtype=torch.float32, device=device)
            self.buf = have[:total * block].view(total, block)
        self.windows = _views(self.buf, codes, lay)
        self.codes = [c.view(sl[1], sl[3]) for c, sl in zip(codes, slots)]
        self.others = [o.view(sl[1], sl[3]) for o, sl in zip(others, slots)]
        tail = () if lay.scales == 1 else (lay.scales,)
        self.scales = [sc.view((-1,) + tail) for sc in scales]
        self.scale_rows = [f.shape[0] for f in self.scales]


def _packing(cache: dict | None, codes: list[Tensor], others: list[Tensor], scales: list[Tensor],
             lay: Layout) -> _Packing:
    if cache is None:
        return _Packing(codes, others, scales, lay)
    k = (lay, tuple(map(id, codes)), tuple(map(id, others)), tuple(map(id, scales)))
    hit = cache.get(k)
    if hit is None:
        hit = cache[k] = _Packing(codes, others, scales, lay, cache.get("pool"))
    return hit


@torch.no_grad()
def decode_(states: list[dict[str, Tensor]], key: str, outs: list[Tensor], moments: str,
            layout: Layout | None = None, cache: dict | None = None) -> None:
    """Write the FP32 values of moment ``key`` of every state into ``outs`` (FP32, the params'
    shapes): one set of vectorised ops per block length. ``cache``: a dict kept by the caller
    while the tensors stay the same (see :class:`_Packing`)."""
    lay = layout or LAYOUTS[moments]
    groups = _groups(outs, lay) if cache is None else cache.setdefault(("groups", tuple(map(id, outs))),
                                                                        _groups(outs, lay))
    for idx in groups:
        _decode([states[i] for i in idx], key, [outs[i] for i in idx], moments, lay, cache)


def _decode(states: list[dict[str, Tensor]], key: str, outs: list[Tensor], moments: str, lay: Layout,
            cache: dict | None = None) -> None:
    pk = _packing(cache, [st[key] for st in states], outs, [st[key + "_scale"] for st in states], lay)
    q = pk.buf.zero_()
    torch._foreach_copy_(pk.windows, pk.codes)
    scale = torch.cat(pk.scales).float()
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
    if vals is not q:
        q.copy_(vals)
    torch._foreach_copy_(pk.others, pk.windows)


@torch.no_grad()
def encode_(states: list[dict[str, Tensor]], key: str, xs: list[Tensor], moments: str,
            generator: torch.Generator | None, cache: dict | None = None) -> None:
    """Store FP32 ``xs`` as moment ``key`` of each state (stochastic rounding for int8, nearest
    for fp8); the rounding noise is drawn once per block length. ``cache``: see :func:`decode_`."""
    lay = LAYOUTS[moments]
    groups = _groups(xs, lay) if cache is None else cache.setdefault(("groups", tuple(map(id, xs))),
                                                                      _groups(xs, lay))
    for idx in groups:
        _encode([states[i] for i in idx], key, [xs[i] for i in idx], moments, lay, generator, cache)


def _encode(states: list[dict[str, Tensor]], key: str, xs: list[Tensor], moments: str, lay: Layout,
            generator: torch.Generator | None, cache: dict | None = None) -> None:
    pk = _packing(cache, [st[key] for st in states], xs, [st[key + "_scale"] for st in states], lay)
    vals = pk.buf.zero_()
    torch._foreach_copy_(pk.windows, pk.others)
    if key == "exp_avg_sq":
        vals = vals.clamp_min_(0).sqrt_()
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
    pk.buf.copy_(q)                      # the windows are views of the buffer, made once
    torch._foreach_copy_(pk.codes, pk.windows)                                 # casts
    torch._foreach_copy_(pk.scales, list(new_scales.split(pk.scale_rows)))


@torch.no_grad()
def upgrade_(st: dict[str, Tensor], moments: str, generator: torch.Generator | None) -> bool:
    """Convert one parameter's state saved in an earlier layout (FP32 scales, ``_LEGACY``; or
    blocks over the flattened tensor, ``_FLAT``) to today's, in place; False when it already is
    today's layout."""
    lay = LAYOUTS.get(moments)
    if lay is None:
        return False
    scale = st["exp_avg_scale"]
    old = _LEGACY.get(moments) if scale.dtype != lay.scale_dtype else None
    if old is None and tuple(scale.shape) != _scale_shape(lay, tuple(st["exp_avg"].shape)):
        old = _FLAT[moments]
    if old is None or old.scale_dtype != scale.dtype:
        return False
    for key in _KEYS:
        code = st[key]
        wide = torch.empty(code.shape, dtype=torch.float32, device=code.device)
        decode_([st], key, [wide], moments, layout=old)
        fresh = new_state(code, moments)
        st[key], st[key + "_scale"] = fresh[key], fresh[key + "_scale"]
        encode_([st], key, [wide], moments, generator)
    return True


def to_bytes_(st: dict[str, Tensor]) -> dict[str, Tensor]:
    """FP8 codes replaced by their bytes (``uint8`` views, the same storage), in place: gloo has no
    FP8 type, so FSDP2's gather and broadcast move FP8 codes as bytes."""
    for key in _KEYS:
        t = st.get(key)
        if t is not None and t.dtype in _FP8:
            st[key] = t.view(torch.uint8)
    return st


def from_bytes_(st: dict[str, Tensor], moments: str) -> dict[str, Tensor]:
    """Inverse of :func:`to_bytes_` for a state in ``moments`` format (in place)."""
    lay = LAYOUTS.get(moments)
    if lay is None or "exp_avg_scale" not in st:
        return st
    for key, code in zip(_KEYS, lay.codes):
        if code in _FP8 and st[key].dtype == torch.uint8:
            st[key] = st[key].view(code)
    return st


def widen_(st: dict[str, Tensor], moments: str, layout: Layout | None = None) -> None:
    """Replace a parameter's 8-bit moments by their FP32 values, in place (a vector loaded from a
    checkpoint that stored its moments in 8 bits, in any layout: a vector's is the same in all)."""
    if layout is None and st["exp_avg_scale"].dtype != LAYOUTS[moments].scale_dtype:
        layout = _LEGACY[moments]
    for key in _KEYS:
        wide = torch.empty(st[key].shape, dtype=torch.float32, device=st[key].device)
        decode_([st], key, [wide], moments, layout=layout)
        st[key] = wide
        del st[key + "_scale"]
