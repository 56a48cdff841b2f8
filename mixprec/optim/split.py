"""Split FP32 masters: the BF16 parameter itself plus a 16-bit remainder, exact.

A BF16 number is the top half of an FP32 bit pattern (same sign and exponent, 7 of the 23
mantissa bits). So an FP32 master ``w`` is fully described by its rounding to BF16 (which is the
model's parameter anyway) and the distance between the two bit patterns:

    hi = bf16(w)                          round to nearest even: what today's copy-back stores
    d  = bits(w) - bits(fp32(hi))         an integer in [-2**15, 2**15] (same sign on both sides)

``d`` needs 16 bits plus one value: ``+2**15`` happens only at an exact tie that rounded *down*
to an even ``hi``, and ``-2**15`` at a tie that rounded *up* to an even ``hi``, so for an even
``hi`` there are 2**16 + 1 masters and no 16-bit code can tell them all apart. The remainder is
stored as ``int16`` (``+2**15`` wraps to ``-2**15``) and the ties that rounded down are marked:
in the step's dense tie bitmap (mixprec.optim.flat_chunk: one bit per element, no data-dependent
shape, no host sync), or, on the per-master paths (mixprec.optim.split_masters, the layout's
optimizer class; this module holds its arithmetic as plain functions), in a short ``int64`` list of flat indices
per tensor (about one element in 2**17 per step; finding them is one ``nonzero``). Modulo 2**16,
``d`` is just the low half of ``w``'s bit pattern (``hi``'s low half is zero), so splitting is a
rounding copy and a copy of half of ``w``'s bytes, with no integer arithmetic. ``join`` reverses it
bit for bit, infinities included; a NaN master stays NaN (its payload may change).

Cost: 2 bytes per parameter instead of 4 (plus a bit for the tie bitmap). The optimizer step
widens one bounded chunk of masters and gradients to FP32 at a time (mixprec.optim.flat; the
per-master fallback in mixprec.optim.split_masters uses ``CHUNK_NUMEL`` chunks), steps it with the inner optimizer's own
math and splits it back, so the update is the FP32 update bit for bit
(tests/optim/test_split_masters.py).

``DeferredGrads`` is the other half of the saving: the step reads the BF16 model gradients
directly, so the loss-scale division and the clip coefficient are not applied to FP32 copies in
place; they are recorded and applied to the FP32 chunk inside the step, in the same order and
with the same FP32 multiplications as today (unscale, then clip), so the values are identical.
The gradient norm for clipping is computed chunk by chunk over the same FP32 values with the
same kernel that ``torch.nn.utils.get_total_norm`` uses.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mixprec.amp.grad_norms import CHUNK_NUMEL, split_norms, widen
from mixprec.errors import ConfigError
from mixprec.optim.parts import SEPARABLE

__all__ = ["split_layout_applies", "splits", "join", "split_", "join_many", "split_many_", "widen", "empty_ties", "DeferredGrads", "CHUNK_NUMEL", "FLAT_CHUNKS", "FLAT_CHUNK_MAX", "CPU_CHUNK_NUMEL", "flat_chunk_numel", "chunks", "chunk_exact",
           "resolve_split"]

FLAT_CHUNKS = 8
FLAT_CHUNK_MAX = 1 << 26
"""The flat step (mixprec.optim.flat) cuts a param group's masters on a device into about
``FLAT_CHUNKS`` chunks, none under ``CHUNK_NUMEL`` nor over ``FLAT_CHUNK_MAX`` (64 Mi) elements:
up to about 0.5 G parameters a step costs a fixed number of ops; above, more chunks, each of whose
ops moves 256 MiB or more (far longer than a kernel launch on any GPU). The FP32 scratch (values
and gradients of one chunk, 8 bytes per element, held only during the step) costs at most about
one byte per parameter and 512 MiB."""


CPU_CHUNK_NUMEL = 1 << 18
"""On a CPU a dispatched op costs microseconds and nothing waits for a launch queue, but memory
does: a chunk of 256 Ki elements keeps the step's working set (1 MiB per FP32 tensor) in the
caches. Measured (2026-12-04, 1 thread, 1.6M-parameter model): 7.3 / 10.4 / 53 ms per step
(full masters / split / int8 moments) against 18 / 19 / 44 with one chunk per group and 9-13 /
13-23 / 83-98 for the per-parameter step before; a shared, noisy machine."""


def flat_chunk_numel(total: int, device_type: str = "cuda") -> int:
    """The element budget of one flat-step chunk of a list of ``total`` elements on a device."""
    if device_type == "cpu":
        return CPU_CHUNK_NUMEL
    return min(max(CHUNK_NUMEL, -(-total // FLAT_CHUNKS)), FLAT_CHUNK_MAX)
_TIE = 1 << 15
_WRAP = 1 << 16


def splits(param_dtype: torch.dtype, master_dtype: torch.dtype = torch.float32) -> bool:
    """Whether the master of a ``param_dtype`` parameter can be stored split: BF16 shares FP32's
    sign and exponent bits, so only BF16 parameters of FP32 masters (FP16's narrower exponent
    would need more than 16 remainder bits)."""
    return param_dtype == torch.bfloat16 and master_dtype == torch.float32


def chunks(numels: list[int], limit: int = CHUNK_NUMEL) -> Iterator[tuple[int, int]]:
    """Split indices [0, n) into consecutive ranges whose element counts sum to at most ``limit``
    (a single larger tensor is a range of its own)."""
    start, total = 0, 0
    for i, n in enumerate(numels):
        if total and total + n > limit:
            yield start, i
            start, total = i, 0
        total += n
    if start < len(numels):
        yield start, len(numels)


def empty_ties(device: torch.device | str) -> Tensor:
    return torch.empty(0, dtype=torch.int64, device=device)


@torch.no_grad()
def join(hi: Tensor, lo: Tensor, ties: Tensor) -> Tensor:
    """The exact FP32 master of BF16 ``hi`` with remainder ``lo`` (int16) and ``ties``."""
    # exact: BF16 -> FP32 appends 16 zero bits; contiguous (row-major), as the flat tie indices
    # and the remainder are: a channels_last ``hi`` would otherwise give a strided ``bits``
    bits = hi.float().contiguous().view(torch.int32)
    bits.add_(lo)                                  # int16 promotes to int32
    if ties.numel():
        bits.view(-1).index_add_(0, ties, torch.full_like(ties, _WRAP, dtype=torch.int32))
    return bits.view(torch.float32)


def _halves(w: Tensor) -> tuple[Tensor, Tensor]:
    """The low and high 16-bit halves of FP32 ``w``'s bit patterns (flat int16 views, no copy)."""
    pairs = w.reshape(-1).view(torch.int16).view(-1, 2)
    return (pairs[:, 0], pairs[:, 1]) if _LITTLE else (pairs[:, 1], pairs[:, 0])


def _ties_of(low: Tensor, high: Tensor) -> Tensor:
    """Flat indices of the exact ties that rounded *down*: low half 0x8000 and an even BF16
    mantissa (bit 16 clear), so round-to-nearest-even kept the truncation."""
    tied = (low == -_TIE).nonzero().squeeze(1)            # 0x8000 as int16: rare
    if tied.numel():
        tied = tied[high[tied].bitwise_and(1) == 0]
    return tied


@torch.no_grad()
def split_(w: Tensor, hi: Tensor, lo: Tensor) -> Tensor:
    """Store FP32 ``w`` as ``hi`` (BF16, round to nearest even, written in place) and ``lo``
    (int16, in place); return the new tie list (flat indices).

    ``hi``'s bit pattern is ``w``'s with the low 16 bits cleared and, when it rounded up, one
    added above them; so ``bits(w) - bits(hi)`` taken modulo 2**16 *is* ``w``'s low half, read as
    a signed int16: the remainder is a copy of half of ``w``'s bytes, no arithmetic."""
    hi.copy_(w)
    low, high = _halves(w.contiguous())
    lo.view(-1).copy_(low)
    return _ties_of(low, high)


_LITTLE = torch.ones(1, dtype=torch.int16).view(torch.int8)[0].item() == 1   # byte order


def _flat_views(tensors: list[Tensor], dtype: torch.dtype) -> tuple[Tensor, list[Tensor]]:
    """One flat buffer of ``dtype`` for all ``tensors`` (one device), and its views shaped like them."""
    numels = [t.numel() for t in tensors]
    flat = torch.empty(sum(numels), dtype=dtype, device=tensors[0].device)
    return flat, [v.view(t.shape) for v, t in zip(flat.split(numels), tensors)]


@torch.no_grad()
def join_many(his: list[Tensor], los: list[Tensor], ties: list[Tensor]) -> list[Tensor]:
    """:func:`join` for a chunk (one device): the FP32 masters as views of one flat buffer,
    built with foreach ops (a handful of launches, whatever the number of tensors)."""
    flat, ws = _flat_views(his, torch.float32)
    torch._foreach_copy_(ws, his)                               # exact BF16 -> FP32
    bits = [w.view(torch.int32) for w in ws]
    torch._foreach_add_(bits, los)                             # int16 promotes in place, no int32 copy
    for b, t in zip(bits, ties):
        if t.numel():
            b.view(-1).index_add_(0, t, torch.full_like(t, _WRAP, dtype=torch.int32))
    return ws


@torch.no_grad()
def split_many_(ws: list[Tensor], his: list[Tensor], los: list[Tensor]) -> list[Tensor]:
    """:func:`split_` for a chunk (one device): round ``ws`` into ``his``, copy the low halves of
    their bit patterns into ``los``; returns the tie lists (one ``nonzero`` for the chunk)."""
    torch._foreach_copy_(his, ws)                               # round to nearest even
    halves = [_halves(w.contiguous()) for w in ws]
    torch._foreach_copy_([lo.view(-1) for lo in los], [low for low, _ in halves])
    numels = [w.numel() for w in ws]
    mask = torch.empty(sum(numels), dtype=torch.bool, device=ws[0].device)
    for (low, _), m in zip(halves, mask.split(numels)):        # a compare per tensor, no sync
        torch.eq(low, -_TIE, out=m)                             # 0x8000: a tie, either way (rare)
    cand = mask.nonzero().squeeze(1)                            # one host sync for the chunk
    empty = empty_ties(mask.device)
    if not cand.numel():
        return [empty] * len(ws)
    starts_list = [0]
    for n in numels[:-1]:
        starts_list.append(starts_list[-1] + n)
    starts = torch.tensor(starts_list, device=mask.device)
    owner = torch.bucketize(cand, starts, right=True) - 1
    counts = torch.bincount(owner, minlength=len(ws)).tolist()
    out = []
    for (_, high), local in zip(halves, (cand - starts[owner]).split(counts)):
        if local.numel():
            local = local[high[local].bitwise_and(1) == 0]      # even mantissa: it rounded down
        out.append(local if local.numel() else empty)
    return out


@dataclass(eq=False)
class DeferredGrads:
    """The gradients of one step of a split-master optimizer, for the scaler and clipping.

    ``low``: the model-dtype gradients of split parameters, read in place by the step (check them
    for inf/NaN; never scale them in place, that would round in BF16). ``own``: FP32 gradients of
    the other parameters (their own masters, or separate masters of FP16 parameters), scaled in
    place as usual. ``entries`` lists both in param-group order (``("own", grad)`` or
    ``("low", grad)``), the order of ``master_grads()``.
    """

    low: list[Tensor]
    own: list[Tensor]
    entries: list[tuple[str, Tensor]]
    factors: list[Tensor] = field(default_factory=list)
    """Pending FP32 multipliers of the ``low`` gradients, applied in order inside the step."""
    closed: bool = False
    """Set when the step (or ``master_grads()``) has consumed the factors."""
    batches: list[tuple[list[int], list[Tensor]]] | None = None
    """From the flat step (mixprec.optim.flat): per chunk, the positions in ``low`` of its split
    gradients and the FP32 scratch views they widen into (allocated once)."""

    @torch.no_grad()
    def scale_(self, factor_for: Callable[[torch.device], Tensor | None]) -> None:
        """Multiply every gradient by ``factor_for(device)`` (a 0-dim FP32 tensor; None: by 1):
        ``own`` ones now, ``low`` ones inside the step."""
        if self.closed:
            raise RuntimeError("these deferred gradients were already used by the step or widened by "
                               "master_grads(); scale the optimizer's current gradients instead")
        groups = torch._C._group_tensors_by_device_and_dtype([self.own], False) if self.own else {}
        for (device, _dtype), ([group], _) in groups.items():
            f = factor_for(device)
            if f is not None:
                torch._foreach_mul_(group, f)
        if self.low:
            f = factor_for(self.low[0].device)
            if f is not None:
                self.factors.append(f)

    @torch.no_grad()
    def norms(self, norm_type: float, foreach: bool | None = None) -> list[Tensor]:
        """Per-tensor ``norm_type``-norms of the FP32 gradients the step will use, in the order
        ``torch.nn.utils.get_total_norm`` stacks them (grouped by device, first seen first).

        ``own`` gradients take one foreach norm per (device, dtype); ``low`` ones are widened one
        bounded batch at a time: into the flat step's scratch views when the optimizer gave them
        (``batches``: a fixed number of ops whatever the number of tensors), else into fresh FP32
        copies of at most ``CHUNK_NUMEL`` elements."""
        return split_norms(self.own, self.low, [g for _, g in self.entries], self.factors,
                           self.batches, norm_type, foreach)


def chunk_exact(optimizer_cls: type[torch.optim.Optimizer]) -> bool:
    """Whether one step of ``optimizer_cls`` over any split of its elements into chunks (or over
    their concatenation) gives every element the same value: an elementwise optimizer."""
    return bool(issubclass(optimizer_cls, SEPARABLE) or getattr(optimizer_cls, "mixprec_chunk_exact", False)
                or getattr(optimizer_cls, "mixprec_separable", None) is True)


def split_layout_applies(optimizer_cls: Any, split: bool | None, master_dtype: Any) -> bool:
    """Whether ``MasterWeights(optimizer_cls, ..., split=split, master_dtype=...)`` builds the
    split layout (arguments it would refuse build the full one, which then says why)."""
    return isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer) \
        and isinstance(master_dtype, torch.dtype) and master_dtype.is_floating_point \
        and resolve_split(split, optimizer_cls, master_dtype)


def resolve_split(split: bool | None, optimizer_cls: type[torch.optim.Optimizer],
                   master_dtype: torch.dtype) -> bool:
    """Whether split masters are used: only where the chunked step is exact (see ``split``)."""
    if split is False:
        return False
    exact = chunk_exact(optimizer_cls)
    if master_dtype != torch.float32:
        exact = False
    if split and not exact:
        raise ConfigError(f"split=True needs FP32 masters and an elementwise optimizer (AdamW, Adam, SGD, "
                          f"...) whose step can be issued chunk by chunk; {optimizer_cls.__name__} with "
                          f"{master_dtype} masters is not one. Use split=False (full FP32 masters)")
    return exact
