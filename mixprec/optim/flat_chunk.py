"""One chunk of the flat step (mixprec.optim.flat): consecutive masters of one param group on one
device, their slots in the shared FP32 scratch ``W``/``G`` and every view of them, made once
(:class:`Chunk`); the split masters' tie bitmap (:func:`pack_ties_`, :func:`unpack_ties`); and
the two moves around the update, each a fixed number of ops over the chunk: :func:`gather`
(masters and gradients into ``W``/``G``) and :func:`scatter` (``W`` back into the masters, the
16-bit params, the remainders and the tie bits)."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.profiler import record_function

from mixprec.optim import split as _split

__all__ = ["Chunk", "gather", "scatter", "pack_ties_", "unpack_ties"]

_TIE = 1 << 15


def unpack_ties(bits: Tensor, n: int, shifts: Tensor) -> Tensor:
    """The first ``n`` tie flags of a packed bitmap (uint8, bit ``j`` of byte ``i`` is element
    ``8 i + j``), as a uint8 tensor of 0/1."""
    return bits.unsqueeze(1).bitwise_right_shift(shifts).bitwise_and_(1).view(-1)[:n]


def pack_ties_(bits: Tensor, flags: Tensor, shifts: Tensor) -> None:
    """Pack bool ``flags`` (length ``8 * bits.numel()``) into ``bits`` in place."""
    packed = flags.view(-1, 8).to(torch.uint8).bitwise_left_shift_(shifts).sum(1, dtype=torch.uint8)
    bits.copy_(packed)


class Chunk:
    """Consecutive masters of one param group on one device, stepped as one flat tensor.

    ``kinds[i]``: ``"split"`` (the BF16 model param + int16 remainder + tie bit), ``"full"`` (a
    separate FP32 master, its 16-bit model param rounded from it) or ``"self"`` (an FP32 param that
    is its own master)."""

    def __init__(self, group: int, masters: list[Tensor], models: list[Tensor], kinds: list[str],
                 los: list[Tensor | None], w: Tensor, g: Tensor, shifts: Tensor, flags: Tensor,
                 mv: tuple[Tensor, Tensor] | None = None) -> None:
        self.group = group
        self.masters, self.models, self.kinds = masters, models, kinds
        self.numels = [p.numel() for p in models]
        self.numel = n = sum(self.numels)
        self.starts = [0]
        for k in self.numels[:-1]:
            self.starts.append(self.starts[-1] + k)
        self.param = w[:n]                 # the twin's parameter: this chunk's slice of W
        self.param.grad = g[:n]
        self.w_views = [self.param[a:a + k].view(p.shape) for a, k, p in zip(self.starts, self.numels, models)]
        self.g_views = [self.param.grad[a:a + k].view(p.shape) for a, k, p in zip(self.starts, self.numels, models)]
        sp = [i for i, k in enumerate(kinds) if k == "split"]
        own = [i for i, k in enumerate(kinds) if k != "split"]
        full = [i for i, k in enumerate(kinds) if k == "full"]
        self.split_idx, self.own_idx, self.full_idx = sp, own, full
        self.split_models = [models[i] for i in sp]
        self.split_w = [self.w_views[i] for i in sp]
        self.split_g = [self.g_views[i] for i in sp]
        self.split_bits = [self.w_views[i].view(torch.int32) for i in sp]
        self.split_lo = [los[i] for i in sp]
        self.split_lo_flat = [los[i].view(-1) for i in sp]
        low, high = _split._halves(self.param)            # flat int16 views of W's halves
        self.low, self.high = low, high
        self.split_low = [low[self.starts[i]:self.starts[i] + self.numels[i]] for i in sp]
        self.own_masters = [masters[i] for i in own]
        self.own_w = [self.w_views[i] for i in own]
        self.own_g = [self.g_views[i] for i in own]
        self.full_models = [models[i] for i in full]
        self.full_w = [self.w_views[i] for i in full]
        self.bits_int = self.param.view(torch.int32)
        nbytes = (n + 7) // 8 if sp else 0
        self.ties = torch.zeros(nbytes, dtype=torch.uint8, device=w.device)   # 1 bit per element, kept
        self.flags = flags[:nbytes * 8]         # bool scratch (shared), its padding zeroed per use
        self.flags_head, self.flags_tail = self.flags[:n], self.flags[n:]
        self.shifts = shifts
        # 8-bit moments: FP32 scratch slots the codes are decoded into and encoded from, and the
        # packing views of mixprec.optim.moments, made at the first step (reset with the state)
        self.m_views = self.v_views = None
        self.moments: dict[str, Tensor] | None = None
        if mv is not None:
            self.moments = {"exp_avg": mv[0][:n], "exp_avg_sq": mv[1][:n]}
            self.m_views = [mv[0][a:a + k].view(p.shape) for a, k, p in zip(self.starts, self.numels, models)]
            self.v_views = [mv[1][a:a + k].view(p.shape) for a, k, p in zip(self.starts, self.numels, models)]
        self.cache: dict = {}
        self.stored: Any = None    # its 8-bit state as bytes (flat_skip.Bytes), for a step skipped on the device
        self.coded: list[int] = []
        self.plain: list[int] = []
        self.ties_packed = False   # False: the owner's per-master tie lists hold the truth
        self.viewed = False        # the inner optimizer's per-master state are views of the twin's
        self.shared: dict[str, Tensor] = {}    # the twin's tensors those views were made of
        self.synced = False        # the twin's state is this chunk's state (adopted or created)


def gather(chunk: Chunk, factors: list[Tensor]) -> None:
    """``W``/``G`` of ``chunk`` from its masters and gradients (flat's docstring, the first four
    lines of a chunk's step): split masters widened exactly (the BF16 param, its remainder, its
    tie bit), their gradients times each pending factor (1/scale, clip coefficient); FP32 masters
    and their gradients copied (unscaled and clipped in place by the scaler already)."""
    with record_function("mixprec.master_grad_copy"):      # the gather (profile: casts)
        if chunk.split_idx:
            torch._foreach_copy_(chunk.split_w, chunk.split_models)    # exact BF16 -> FP32
            torch._foreach_add_(chunk.split_bits, chunk.split_lo)       # + remainder (int16 -> int32)
            chunk.bits_int.add_(unpack_ties(chunk.ties, chunk.numel, chunk.shifts), alpha=1 << 16)
            torch._foreach_copy_(chunk.split_g, [p.grad for p in chunk.split_models])
            for f in factors:                                          # unscale, then clip
                torch._foreach_mul_(chunk.split_g, f.to(chunk.param.device))
        if chunk.own_idx:   # after the tie add: it touched the own slots too
            torch._foreach_copy_(chunk.own_w, chunk.own_masters)
            torch._foreach_copy_(chunk.own_g, [m.grad for m in chunk.own_masters])


def scatter(chunk: Chunk) -> None:
    """``W`` of ``chunk`` back (the last three lines of a chunk's step): the BF16 params rounded
    to nearest even, the remainders as W's low halves and the ties that rounded down packed; FP32
    masters copied; the 16-bit params of full masters rounded from them."""
    with record_function("mixprec.master_copy_back"):      # the scatter (profile: casts)
        if chunk.split_idx:
            torch._foreach_copy_(chunk.split_models, chunk.split_w)    # round to nearest even
            torch._foreach_copy_(chunk.split_lo_flat, chunk.split_low) # remainder = low half
            tied = torch.eq(chunk.low, -_TIE)                          # 0x8000: a tie either way
            even = chunk.high.bitwise_and(1).eq_(0)                    # ... that rounded down
            torch.logical_and(tied, even, out=chunk.flags_head)
            chunk.flags_tail.zero_()
            pack_ties_(chunk.ties, chunk.flags, chunk.shifts)
        if chunk.own_idx:
            torch._foreach_copy_(chunk.own_masters, chunk.own_w)
        if chunk.full_idx:
            torch._foreach_copy_(chunk.full_models, chunk.full_w)      # round into the model dtype
