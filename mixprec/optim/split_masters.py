"""Split FP32 masters: the master of a BF16 param stored as the param itself plus a 16-bit remainder.

The layout, whole in this file: what it stores (:class:`SplitMasters`, the table of masters:
per BF16 param an ``int16`` remainder and its rounding ties, the arithmetic in
:mod:`mixprec.optim.split`; the inner optimizer keys its state by an empty FP32 *holder* per split
master; the ties packed into the flat chunks' bitmaps and back), how it steps
(:class:`SplitMasterWeights`) and how it saves and loads. The rest of the bookkeeping, the full
FP32 masters of other params (FP16 ones) and the flat step are
:class:`mixprec.optim.master.MasterWeights`' (and the modules it is composed of), which this class
extends (single inheritance: ``MasterWeights(...)`` builds one wherever split masters are exact,
see ``split.resolve_split``; ``Precision`` builds it where ``recipe.masters`` is ``split``). Where
the masters split is this file's rule too (:class:`SplitMasters`).

The step:

* the flat step (mixprec.optim.flat), whenever it applies: the BF16 params, remainders and tie
  bitmap are gathered into the chunk's FP32 scratch and the BF16 grads widened there, the
  loss-scale and clip factors recorded by :meth:`deferred_grads` applied on the way; the ties are
  a dense bitmap per chunk (packed from the per-master tie lists once, ``SplitMasters.enter_flat``);
* the per-master fallback (a step in parts for the overlap engine, a step in which some trainable
  master has no grad, grads widened by ``master_grads()`` for torch's ``GradScaler``): chunks of
  at most ``split.CHUNK_NUMEL`` elements are widened into **FP32 tensors of the inner optimizer's
  own** (``_widen``: joined values, widened grads), which stand in the param groups for their
  holders for the chunk's step, the holder's state moved onto them and back; after the inner
  step they are split back into the param and its remainder (``_narrow``). No tensor's ``.data``
  is swapped: the holders stay empty, the inner optimizer steps ordinary FP32 tensors.
  ``master_grads()`` widens every split master that way until the step (torch's ``GradScaler``
  unscales the grads it finds in ``param_groups``).

The checkpoint is the full-master one (``MasterWeights.state_dict``): split masters are joined
into FP32 tensors on save and split again on load (``SplitMasters.load_own``), so files move between the
two layouts.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.profiler import record_function

from mixprec.optim import flat_dispatch, split as _split
from mixprec.optim.flat import FlatSteps
from mixprec.optim.flat_chunk import pack_ties_, unpack_ties
from mixprec.optim.master import MasterWeights
from mixprec.optim.master_table import Masters

__all__ = ["SplitMasterWeights", "SplitMasters"]


class SplitMasters(Masters):
    """:class:`mixprec.optim.master_table.Masters` with the FP32 master of each BF16 param stored
    as the param plus an int16 remainder (``lo``) and the flat indices of its ties that rounded
    down (``ties``), both by id of the storage-free FP32 *holder* the inner optimizer keys its
    state by (the arithmetic: mixprec.optim.split). The layout's rule, here only: split wherever
    exact, i.e. a BF16 param of an FP32 master (``split.splits``) under an elementwise inner
    optimizer (``elementwise``, ``split.chunk_exact``); full masters for the rest (FP16 params)."""

    def __init__(self, master_dtype: torch.dtype, param_dtype: torch.dtype | None,
                 wanted: set[int] | None, *, elementwise: bool = False) -> None:
        super().__init__(master_dtype, param_dtype, wanted, elementwise=elementwise)
        self.split = elementwise and master_dtype == torch.float32   # splits BF16 params' masters
        self.lo: dict[int, Tensor] = {}      # id(holder) -> int16 remainder
        self.ties: dict[int, Tensor] = {}    # id(holder) -> flat indices of the ties that rounded down
        # The step's FP32 stand-ins (SplitMasterWeights._widen) and what is still to widen:
        self.pending: set[int] = set()       # split holders with a grad, not yet widened this step
        self.wide: dict[int, Tensor] = {}    # id(holder) -> its FP32 tensor, in the groups for now
        self.holder_of: dict[int, Tensor] = {}   # id(FP32 tensor) -> holder

    def store(self, p: Tensor, exact: Tensor) -> Tensor:
        """Keep ``exact`` as ``p`` + remainder; return the (storage-free) holder."""
        if not (self.split and _split.splits(p.dtype, self.master_dtype)):
            return exact
        lo = torch.empty(p.shape, dtype=torch.int16, device=p.device)
        ties = _split.split_(exact, p.detach(), lo)
        holder = torch.empty(0, dtype=self.master_dtype, device=p.device).requires_grad_(p.requires_grad)
        self.lo[id(holder)], self.ties[id(holder)] = lo, ties
        return holder

    def is_split(self, m: Tensor) -> bool:
        return id(m) in self.lo

    def remainder_of(self, m: Tensor) -> Tensor | None:
        return self.lo.get(id(m))

    @property
    def split_count(self) -> int:
        return len(self.lo)

    def reads_model_grad(self, m: Tensor) -> bool:
        return self.is_split(m) and id(m) not in self.wide

    def widened(self) -> bool:
        return bool(self.wide)

    def prepare_grads(self) -> list[Tensor]:
        """As :meth:`Masters.prepare_grads`; the split masters with a grad are to be widened."""
        if self.grads_ready:
            return []
        deferred = super().prepare_grads()
        self.pending = {id(m) for m in deferred}
        return deferred

    def end_step(self) -> None:
        super().end_step()
        self.pending = set()

    @torch.no_grad()
    def enter_flat(self, flat: FlatSteps) -> None:
        """The per-master tie lists into the chunks' bitmaps (once after a load or a per-master
        step: the lists are host-sized, the bitmaps are not)."""
        for chunk in flat.chunks:
            if not chunk.split_idx or chunk.ties_packed:
                continue
            chunk.flags.zero_()
            for i in chunk.split_idx:
                ties = self.ties[id(chunk.masters[i])]
                if ties.numel():
                    chunk.flags[chunk.starts[i] + ties] = True
            pack_ties_(chunk.ties, chunk.flags, chunk.shifts)
            chunk.ties_packed = True

    @torch.no_grad()
    def leave_flat(self, flat: FlatSteps | None) -> None:
        """The chunks' bitmaps back into per-master tie lists, for the per-master paths (slow
        paths only)."""
        for chunk in flat.chunks if flat is not None else ():
            if not chunk.ties_packed:
                continue
            flags = unpack_ties(chunk.ties, chunk.numel, chunk.shifts)
            for i in chunk.split_idx:
                a, n = chunk.starts[i], chunk.numels[i]
                self.ties[id(chunk.masters[i])] = flags[a:a + n].nonzero().squeeze(1)
            chunk.ties_packed = False

    def load_own(self, p: Tensor, m: Tensor, saved: Tensor) -> bool:
        """A saved FP32 master of a split param: split again into the param and its remainder."""
        if not self.is_split(m):
            return False
        w = saved.to(device=p.device, dtype=torch.float32, copy=True)
        self.ties[id(m)] = _split.split_(w, p.detach(), self.lo[id(m)])
        return True

    @torch.no_grad()
    def sync_from_model(self) -> None:
        super().sync_from_model()
        for m in self.masters:
            if self.is_split(m):
                self.lo[id(m)].zero_()
                self.ties[id(m)] = _split.empty_ties(m.device)


class SplitMasterWeights(MasterWeights, split_layout=True):
    """:class:`MasterWeights` with the FP32 master of each BF16 param stored split (2 bytes, not 4).

    Built where ``recipe.masters`` is ``split`` (``Precision``'s params plugin: this class, or
    ``AdamW(..., layout=SplitMasterWeights)``), and by ``MasterWeights(...)`` where split masters
    are exact. It splits wherever that is exact, by :class:`SplitMasters`' rule. Same
    constructor, public methods and ``state_dict()`` as :class:`MasterWeights`; bit-identical
    steps (tests/optim/test_split_masters.py).
    """

    _table_cls = SplitMasters
    _table: SplitMasters

    def __init__(self, optimizer_cls: type[torch.optim.Optimizer], params: Any, **kwargs: Any) -> None:
        self._deferred: _split.DeferredGrads | None = None
        super().__init__(optimizer_cls, params, **kwargs)

    @property
    def _full(self) -> bool:
        """Built over the full layout's storage (``mixprec.optim.AdamW(..., layout=MasterWeights)``,
        one class over both layouts): this class's methods are then :class:`MasterWeights`'."""
        return not isinstance(self._table, SplitMasters)

    # ------------------------------------------------------------------ what it stores
    def master_of(self, param: Tensor) -> Tensor:
        """The FP32 master of a model param. For a split master outside the step this is a fresh
        FP32 tensor joined from the param and its remainder: read it again after a step to see
        the new value (while widened for the step, the FP32 tensor the inner optimizer steps)."""
        m = super().master_of(param)
        if self._full:
            return m
        if id(m) in self._table.wide:
            return self._table.wide[id(m)]
        if self._table.is_split(m):
            self._table.leave_flat(self._flat)
            return _split.join(param.detach(), self._table.lo[id(m)], self._table.ties[id(m)])
        return m

    def step_grads(self, param: Tensor) -> list[Tensor]:
        """The gradient tensors the step reads for ``param``: for a split master the model
        param's own (BF16) grad, which the step widens itself (and its FP32 copy, if widened)."""
        m = self._table.master_of.get(id(param))
        if m is None or self._full or not self._table.is_split(m):
            return super().step_grads(param)
        w = self._table.wide.get(id(m))
        return [g for g in (w.grad if w is not None else None, param.grad) if g is not None]

    # ------------------------------------------------------------------ the step's grads
    def deferred_grads(self) -> _split.DeferredGrads | None:
        """The step's gradients without FP32 copies of the split ones (mixprec.optim.split), or
        None when nothing is deferred (no split masters with a grad): then use ``master_grads()``.
        Same object until ``step()`` or ``zero_grad()``."""
        if self._full:
            return super().deferred_grads()
        if self._deferred is not None:
            return self._deferred
        self._table.prepare_grads()
        if not self._table.pending:
            return None
        entries = []
        for group in self.param_groups:
            for m in group["params"]:
                if id(m) in self._table.pending:
                    entries.append(("low", self._table.model_of[id(m)].grad))
                elif m.grad is not None:
                    entries.append(("own", m.grad))
        low = [g for k, g in entries if k == "low"]
        self._deferred = _split.DeferredGrads(low=low, own=[g for k, g in entries if k == "own"],
                                              entries=entries, batches=self._flat_batches(low))
        return self._deferred

    def _grad_factors(self) -> list[Tensor]:
        return self._deferred.factors if self._deferred is not None else []

    @torch.no_grad()
    def master_grads(self) -> list[Tensor]:
        """As :meth:`MasterWeights.master_grads`; split masters are widened for this step into
        FP32 tensors that stand in the param groups until the step (the memory of full masters):
        mixprec's scaler and clipping use :meth:`deferred_grads` instead."""
        if self._full:
            return super().master_grads()
        self._table.prepare_grads()
        if self._table.pending:
            self._widen([m for m in self._table.masters if id(m) in self._table.pending])
            if self._deferred is not None:
                self._deferred.closed = True
                self._deferred = None
        return super().master_grads()

    def _end_step(self) -> None:
        if self._full:
            super()._end_step()
            return
        self._narrow([m for m in self._table.masters if id(m) in self._table.wide], store=False)
        super()._end_step()
        if self._deferred is not None:
            self._deferred.closed = True
            self._deferred = None

    # ------------------------------------------------------------------ the flat step
    def _flat_batches(self, low: list[Tensor]) -> list[tuple[list[int], list[Tensor]]] | None:
        """For the norms of deferred gradients (``split.DeferredGrads``): per chunk, positions of
        its split grads in ``low`` and their FP32 scratch views; None when this step is not flat."""
        if not flat_dispatch.ready(self):
            return None
        assert self._flat is not None
        pos = {id(g): i for i, g in enumerate(low)}
        out = []
        for chunk in self._flat.chunks:
            if chunk.split_idx:
                idx = [pos.get(id(p.grad)) for p in chunk.split_models]
                if any(i is None for i in idx):
                    return None
                out.append((idx, chunk.split_g))
        return out

    # ------------------------------------------------------------------ the per-master step
    def _step_per_master(self, parts: Sequence[Sequence[Tensor]] | None,
                         around: Callable[[int], contextlib.AbstractContextManager] | None,
                         found_on_device: Tensor | None) -> None:
        if self._full or not self._table.lo:
            super()._step_per_master(parts, around, found_on_device)
            return
        self._step_split(parts, around)

    def _slots(self) -> dict[int, tuple[int, int]]:
        """id(tensor in the param groups) -> (group index, position)."""
        return {id(t): (gi, i) for gi, g in enumerate(self.param_groups) for i, t in enumerate(g["params"])}

    def _stand_in(self, old: Tensor, new: Tensor, slots: dict[int, tuple[int, int]]) -> None:
        """``new`` takes ``old``'s place in its param group and its optimizer state."""
        gi, i = slots[id(old)]
        self.param_groups[gi]["params"][i] = new
        st = self.state.pop(old, None)
        if st is not None:
            self.state[new] = st

    @torch.no_grad()
    def _widen(self, masters: list[Tensor]) -> None:
        """Give split ``masters`` FP32 tensors of their own for the inner optimizer: the joined
        values, with the FP32 grads (unscale/clip factors applied) as their ``.grad``."""
        todo = [m for m in masters if id(m) in self._table.pending]
        if not todo:
            return
        flat_dispatch.leave(self)
        params = [self._table.model_of[id(m)] for m in todo]
        with record_function("mixprec.master_grad_copy"):    # the BF16 -> FP32 widening, per chunk
            grads = _split.widen([p.grad for p in params], self._grad_factors())
        ws: list[Tensor | None] = [None] * len(todo)
        for dev in {p.device for p in params}:
            idx = [i for i, p in enumerate(params) if p.device == dev]
            joined = _split.join_many([params[i].detach() for i in idx], [self._table.lo[id(todo[i])] for i in idx],
                                      [self._table.ties[id(todo[i])] for i in idx])
            for i, w in zip(idx, joined):
                ws[i] = w
        slots = self._slots()
        for m, w, g in zip(todo, ws, grads):
            assert w is not None
            w.grad = g
            self._stand_in(m, w, slots)
            self._table.wide[id(m)] = w
            self._table.holder_of[id(w)] = m
            self._table.pending.discard(id(m))

    @torch.no_grad()
    def _narrow(self, masters: list[Tensor], *, store: bool) -> None:
        """Split the FP32 tensors of widened ``masters`` back into their params (``store``) or
        just drop them; the holders take their places and state back."""
        wide = [m for m in masters if id(m) in self._table.wide]
        if not wide:
            return
        ws = [self._table.wide[id(m)] for m in wide]
        for w in ws:
            w.grad = None                  # freed before the split's temporaries are made
        if store:
            for dev in {w.device for w in ws}:
                idx = [i for i, w in enumerate(ws) if w.device == dev]
                ties = _split.split_many_([ws[i] for i in idx], [self._table.model_of[id(wide[i])].detach() for i in idx],
                                          [self._table.lo[id(wide[i])] for i in idx])
                for i, t in zip(idx, ties):
                    self._table.ties[id(wide[i])] = t
        slots = self._slots()
        for m, w in zip(wide, ws):
            self._stand_in(w, m, slots)
            del self._table.wide[id(m)], self._table.holder_of[id(w)]

    def _step_split(self, parts: Sequence[Sequence[Tensor]] | None,
                    around: Callable[[int], contextlib.AbstractContextManager] | None) -> None:
        """The per-master step with split masters: per param group and device, chunks of at most
        ``split.CHUNK_NUMEL`` elements are widened, stepped by the inner optimizer over a view of
        the groups holding only that chunk, and split back (the BF16-moment AdamW draws its
        rounding noise per chunk of the same boundaries, so it steps bit-identically too)."""
        inner, whole = self._inner, self.param_groups
        units: Sequence[Sequence[Tensor] | None] = [None] if parts is None else parts
        stepped = {id(m) for m in self._table.stepped[1]}
        try:
            for i, unit in enumerate(units):
                keep = None if unit is None else {id(self._table.master_of[id(p)]) for p in unit}
                with (around(i) if around is not None else contextlib.nullcontext()):
                    for gi, group in enumerate(whole):
                        holders = [self._table.holder_of.get(id(t), t) for t in group["params"]]
                        ms = [m for m in holders if (keep is None or id(m) in keep)
                              and (m.grad is not None or id(m) in self._table.pending or id(m) in self._table.wide)]
                        by_device: dict[torch.device, list[Tensor]] = {}
                        for m in ms:
                            by_device.setdefault(m.device, []).append(m)
                        for dev_ms in by_device.values():
                            numels = [self._table.model_of[id(m)].numel() if id(m) in self._table.model_of else m.numel()
                                      for m in dev_ms]
                            for a, b in _split.chunks(numels):
                                chunk = dev_ms[a:b]
                                self._widen(chunk)
                                own = [self._table.wide.get(id(m), m) for m in chunk]
                                inner.param_groups = [{**g, "params": own if j == gi else []}
                                                      for j, g in enumerate(whole)]
                                inner.step()
                                self._store_chunk(chunk, stepped)
        finally:
            inner.param_groups = whole

    @torch.no_grad()
    def _store_chunk(self, chunk: list[Tensor], stepped: set[int]) -> None:
        with record_function("mixprec.master_copy_back"):
            self._narrow([m for m in chunk if id(m) in self._table.wide], store=True)
            full = [m for m in chunk if id(m) in stepped and not self._table.is_split(m)
                    and self._table.model_of.get(id(m)) is not None]
            if full:
                torch._foreach_copy_([self._table.model_of[id(m)] for m in full], full)
