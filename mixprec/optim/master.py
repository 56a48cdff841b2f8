"""FP32 master weights around any ``torch.optim`` optimizer.

Why masters: an FP16 parameter near 1.0 has a ULP of 2**-10. An update ``lr * grad`` below half
of that rounds away, every step, forever, so a low-precision model stops learning long before its
loss says so. Keeping an FP32 copy ("master") of every low-precision parameter, stepping the
optimizer on the masters and rounding the result back into the model after each step lets those
small updates accumulate until they are large enough to show in the model's dtype.

How it fits the grad protocol with ``mixprec.amp.GradScaler`` (docs/CONTRACTS.md):

1. ``backward()`` writes low-precision grads into the model params.
2. ``master_grads()`` copies them (one foreach cast-copy) into the masters' FP32 ``.grad`` and
   returns those tensors; the scaler unscales / checks / clips them in place. Calling it twice in a
   step is harmless: the copy happens once until the next ``step()`` or ``zero_grad()``.
3. ``step()`` calls ``master_grads()`` if nobody did, steps the inner optimizer on the masters and
   copies the masters back into the model params with one foreach cast-copy.
4. If the scaler skips the step, ``step()`` is never called and the model params, the masters and
   the optimizer state stay bitwise as they were.

``torch.amp.GradScaler`` knows nothing of ``master_grads()``: it unscales the grads of
``param_groups`` (the masters), which are empty until the grads are moved. With it, call
``optimizer.master_grads()`` right after ``backward()`` and before ``scaler.unscale_``/``scaler.step``.

Params already in the master dtype are their own master (no copy, no extra memory). An FP16
param with an FP32 master and Adam moments costs 2 + 4 + 8 = 14 bytes instead of 12 for plain FP32,
plus 4 bytes of FP32 master gradient during the step.

**Split masters** (``split=None``, the default, turns them on wherever they are exact): the FP32
master of a BF16 param is stored as the BF16 param itself plus a 16-bit remainder
(mixprec.optim.split), 2 bytes instead of 4, and no FP32 master gradients are kept: the step widens
one bounded chunk of masters and BF16 gradients at a time, steps it with the inner optimizer and
splits it back, bit-identical to the FP32-master step. The loss-scale division and the clip
coefficient are deferred into that widening (``deferred_grads()``, used by mixprec's scaler and
``clip_grad_norm_``). ``master_grads()`` still works for other callers (``torch.amp.GradScaler``):
it widens everything for that step, as before. Gradient accumulation is unchanged: autograd sums
the micro-batches into the BF16 ``.grad``, exactly as with full masters.

The step itself is flat (:mod:`mixprec.optim.flat`): the masters of each param group and device
are stepped as a few flat FP32 chunks by a twin of the inner optimizer, a fixed number of ops
whatever the number of parameters, no host sync, and a non-finite step can be skipped on the device
(``step(inputs=StepInputs(found_inf=...))``, :mod:`mixprec.optim.inputs`). The per-master step
below (the inner optimizer over the masters, split masters widened chunk by chunk) is the
fallback for what the flat step cannot do (see flat's docstring); both give the same bits.

Where the rest lives: the per-master split step in :mod:`mixprec.optim.split` (``SplitSteps``),
saving and loading in :mod:`mixprec.optim.master_state` (``MasterState``); both are mixins of
:class:`MasterWeights`, which holds the bookkeeping they read.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.profiler import record_function

from mixprec.optim import inputs as _inputs, registry, sharded as _sharded, split as _split
from mixprec.optim.flat import FlatSteps, pack_ties_, unpack_ties
from mixprec.optim.inputs import StepInputs
from mixprec.optim.master_state import MasterState
from mixprec.optim.split import SplitSteps, resolve_split
from mixprec.errors import ConfigError

__all__ = ["MasterWeights"]


def _normalise_groups(params: Iterable[Tensor] | Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Turn the ``params`` argument of an optimizer into a list of group dicts (copies)."""
    if isinstance(params, Tensor):
        raise ConfigError("params must be an iterable of tensors or of param-group dicts, not a single "
                          "tensor; pass model.parameters() or [tensor]")
    groups = list(params)
    if not groups:
        raise ConfigError("the optimizer got an empty parameter list; pass model.parameters() of a model "
                          "that has parameters")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    out = []
    for group in groups:
        group = dict(group)
        ps = group["params"]
        group["params"] = [ps] if isinstance(ps, Tensor) else list(ps)
        out.append(group)
    return out


class MasterWeights(MasterState, SplitSteps, torch.optim.Optimizer):
    """Step any ``torch.optim`` optimizer on FP32 masters of low-precision model parameters.

    Args:
        optimizer_cls: the optimizer class to run on the masters (``torch.optim.SGD``, ``Adam``,
            ``AdamW``, ...). It is constructed with the master param groups and ``**optimizer_kwargs``.
        params: model parameters or param-group dicts, exactly as a torch optimizer takes them.
        master_dtype: dtype of the masters. Params already in this dtype are their own master.
        param_dtype: if given, floating-point params in ``master_dtype`` are converted **in place**
            to this dtype after their masters have been taken (so the masters keep the exact
            initial FP32 values). Their existing ``.grad`` is dropped. ``None`` converts nothing.
        split: store the FP32 master of each BF16 param as the param plus a 16-bit remainder
            (see the module docstring). ``None`` (default): wherever exact, i.e. FP32 masters of
            BF16 params with an inner optimizer whose step may be issued chunk by chunk (the
            elementwise ``mixprec.optim.parts.SEPARABLE`` ones, or a class declaring
            ``mixprec_chunk_exact = True``). ``True`` refuses other optimizers; ``False`` keeps
            full FP32 masters.
        master_params: the parameters that get a separate FP32 master, exactly these: the per-layer
            table's ``master`` column (``Precision.master_params(model)``; ``Precision.setup``
            passes it). Listed FP32 params are converted to ``param_dtype`` when it is given;
            unlisted params are their own master (stepped in place, in their dtype). ``None``
            (a hand-built optimizer): every floating param not in ``master_dtype`` gets one, and
            with ``param_dtype`` every FP32 param except those the decider recorded as kept FP32
            (``mixprec.optim.registry.kept_fp32``: ``Precision.setup``/``cast_module`` and
            ``mark_fp32_params`` record the table's FP32 islands there).

    It *is* a ``torch.optim.Optimizer`` (so LR schedulers accept it): ``param_groups`` and
    ``state`` are the inner optimizer's own objects, holding the masters, so editing
    ``param_groups[i]["lr"]`` reaches the inner optimizer. Params with ``requires_grad=False`` or
    without a grad are skipped by ``step()`` like torch does; they still get a master, so pass
    only trainable params if frozen ones are large.
    """

    def __init__(
        self,
        optimizer_cls: type[torch.optim.Optimizer],
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        *,
        master_dtype: torch.dtype = torch.float32,
        param_dtype: torch.dtype | None = None,
        split: bool | None = None,
        master_params: Iterable[Tensor] | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise ConfigError(f"optimizer_cls must be a torch.optim.Optimizer subclass, got {optimizer_cls!r}; "
                              "pass e.g. torch.optim.AdamW (the class, not an instance)")
        if optimizer_cls is torch.optim.LBFGS:
            raise ConfigError("LBFGS re-evaluates its closure many times per step, which master weights "
                              "cannot follow; use LBFGS on FP32 params without MasterWeights")
        if not master_dtype.is_floating_point:
            raise ConfigError(f"master_dtype must be a floating-point dtype, got {master_dtype}; "
                              "use torch.float32")
        if param_dtype is not None and not param_dtype.is_floating_point:
            raise ConfigError(f"param_dtype must be a floating-point dtype, got {param_dtype}; "
                              "use torch.float16 or torch.bfloat16")
        self.master_dtype = master_dtype
        self.param_dtype = param_dtype
        self.split = resolve_split(split, optimizer_cls, master_dtype)
        self._lo: dict[int, Tensor] = {}      # id(placeholder master) -> int16 remainder
        self._ties: dict[int, Tensor] = {}    # id(placeholder master) -> flat indices of the ties
        self._deferred: _split.DeferredGrads | None = None
        # Pairs (model param, separate master); self-mastered params are not listed here.
        self._model_params: list[Tensor] = []
        self._masters: list[Tensor] = []
        self._master_of: dict[int, Tensor] = {}  # id(model param) -> master (separate or itself)
        self._all_model_params: list[Tensor] = []  # flat order of the param groups
        self._grads_ready = False
        self._stepped: tuple[list[Tensor], list[Tensor]] = ([], [])  # (model params, masters) to copy back
        self._model_of: dict[int, Tensor] = {}  # id(separate master) -> model param
        self._pending: set[int] = set()   # split masters with a grad, not yet widened this step
        self._wide: set[int] = set()      # split masters holding FP32 values right now
        self._wanted: set[int] | None = None if master_params is None else {id(p) for p in master_params}
        self._grad_of: dict[int, Tensor] = {}    # id(separate master) -> its FP32 grad, allocated once
        self._twin_args = (optimizer_cls, dict(optimizer_kwargs))
        self._flat: FlatSteps | None = None     # built at the first flat step (mixprec.optim.flat)

        master_groups = [self._make_master_group(g) for g in _normalise_groups(params)]
        self._inner = optimizer_cls(master_groups, **optimizer_kwargs)
        # The flat step (mixprec.optim.flat) needs an elementwise inner optimizer on FP32 masters:
        # one call over a concatenation must give each element what the per-master call gave.
        self._flat_capable = _split.chunk_exact(optimizer_cls) and master_dtype == torch.float32
        self._constructing = True
        super().__init__(self._inner.param_groups, self._inner.defaults)
        self._constructing = False
        self._alias_inner()
        registry.remember(self, self._all_model_params)

    # ------------------------------------------------------------------ construction helpers
    def _make_master_group(self, group: dict[str, Any]) -> dict[str, Any]:
        masters = []
        for p in group["params"]:
            if id(p) in self._master_of:
                raise ConfigError("a parameter appears twice in the optimizer's param groups; "
                                  "pass each parameter once")
            masters.append(self._make_master(p))
        return {**group, "params": masters}

    @torch.no_grad()
    def _make_master(self, p: Tensor) -> Tensor:
        if not p.is_leaf:
            raise ConfigError("can't optimize a non-leaf tensor; pass the model's parameters")
        self._all_model_params.append(p)
        if not p.is_floating_point() or not self._needs_master(p):
            self._master_of[id(p)] = p  # its own master
            return p
        master = p.detach().to(self.master_dtype, copy=True).requires_grad_(p.requires_grad)
        if p.dtype == self.master_dtype:  # convert the model param in place, keep the exact master
            p.data = p.data.to(self.param_dtype)
            p.grad = None
        if self.split and _split.splits(p.dtype, self.master_dtype):
            master = self._make_split(p, master)
        self._model_params.append(p)
        self._masters.append(master)
        self._model_of[id(master)] = p
        self._master_of[id(p)] = master
        return master

    def _needs_master(self, p: Tensor) -> bool:
        """A separate master for ``p``: the given set decides; without one, its dtype does (and,
        when converting, the decider's record of FP32 islands)."""
        if self._wanted is not None:
            return id(p) in self._wanted and (p.dtype != self.master_dtype or self.param_dtype is not None)
        if p.dtype != self.master_dtype:
            return True
        return self.param_dtype is not None and not registry.kept_fp32(p)

    def _alias_inner(self) -> None:
        """Share the inner optimizer's ``param_groups`` list and ``state`` dict (not copies)."""
        self.param_groups = self._inner.param_groups
        self.state = self._inner.state
        self.defaults = self._inner.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of model params (e.g. when unfreezing layers); masters are made for it."""
        if getattr(self, "_constructing", True):
            # Called by Optimizer.__init__ with the inner optimizer's (master) groups.
            super().add_param_group(param_group)
            return
        (group,) = _normalise_groups([param_group])
        self._inner.add_param_group(self._make_master_group(group))
        self._alias_inner()
        self._drop_flat()

    # ------------------------------------------------------------------ public API
    @property
    def inner(self) -> torch.optim.Optimizer:
        """The optimizer that steps the masters."""
        return self._inner

    @property
    def masters(self) -> list[Tensor]:
        """The separate masters (one per low-precision param), in param-group order. A split
        master is joined into a fresh FP32 tensor (a copy: writing to it changes nothing)."""
        return [self.master_of(p) for p in self._model_params]

    @property
    def split_count(self) -> int:
        """How many parameters keep a split master (the parameter + a 16-bit remainder)."""
        return len(self._lo)

    def master_of(self, param: Tensor) -> Tensor:
        """The FP32 master of a model param (the param itself when it is already in the master
        dtype). For a split master outside the step this is a fresh FP32 tensor joined from the
        param and its remainder: read it again after a step to see the new value."""
        try:
            m = self._master_of[id(param)]
        except KeyError:
            raise ConfigError("this tensor is not one of the optimizer's parameters") from None
        if self._is_split(m) and id(m) not in self._wide:
            self._unpack_ties()
            return self._join(param, m)
        return m

    def updates(self, param: Tensor) -> bool:
        """Whether ``param`` is one of the model params this optimizer steps (no copy made)."""
        return id(param) in self._master_of

    def step_grads(self, param: Tensor) -> list[Tensor]:
        """The gradient tensors the step reads for ``param``: its master's FP32 ``.grad`` and,
        for a split master, the model param's own (BF16) grad, which the step widens itself."""
        m = self._master_of.get(id(param))
        out = [g for g in (m.grad if m is not None else None,) if g is not None]
        if m is not None and self._is_split(m) and param.grad is not None:
            out.append(param.grad)
        return out

    @torch.no_grad()
    def _prepare_grads(self) -> None:
        """Once per step: copy the grads of full (non-split) masters into their FP32 ``.grad`` and
        note which split masters have a grad (their BF16 grad is read by the step itself)."""
        if self._grads_ready:
            return
        src, dst, stepped_params, stepped_masters, pending = [], [], [], [], []
        for p, m in zip(self._model_params, self._masters):
            if p.grad is None:
                m.grad = None
                continue
            if p.grad.is_sparse:
                raise ConfigError("sparse gradients are not supported with master weights; "
                                  "use a dense embedding (sparse=False)")
            stepped_params.append(p)
            stepped_masters.append(m)
            if self._is_split(m):
                if id(m) not in self._wide:
                    pending.append(m)
                continue
            if m.grad is None or m.grad.shape != m.shape:
                buf = self._grad_of.get(id(m))
                if buf is None or buf.shape != m.shape:    # once, not per step: no per-master op
                    buf = self._grad_of[id(m)] = torch.empty_like(m)
                storage = buf.untyped_storage()
                if storage.nbytes() == 0:                  # freed by zero_grad(set_to_none=True)
                    storage.resize_(buf.numel() * buf.element_size())
                m.grad = buf
            src.append(p.grad)
            dst.append(m.grad)
        if dst:
            with record_function("mixprec.master_grad_copy"):
                torch._foreach_copy_(dst, src)  # one cast-copy launch per (device, dtype) bucket
        self._stepped = (stepped_params, stepped_masters)
        self._pending = {id(m) for m in pending}
        self._grads_ready = True

    @torch.no_grad()
    def master_grads(self) -> list[Tensor]:
        """Copy low-precision model grads into the masters' FP32 ``.grad``; return all master grads.

        The returned tensors are the ones ``step()`` will use: unscale, check or clip them in
        place. The copy happens once per step; later calls return the same tensors without copying
        again, until ``step()`` or ``zero_grad()``. Params whose grad is ``None`` are left out (and
        their master's grad is set to ``None`` so the inner optimizer skips them). With split
        masters this widens every split master and its grad to FP32 for this step (the memory of
        full masters); mixprec's scaler and clipping use :meth:`deferred_grads` instead.
        """
        self._prepare_grads()
        if self._pending:
            wide = [m for m in self._masters if id(m) in self._pending]
            self._widen(wide)
            if self._deferred is not None:
                self._deferred.closed = True
                self._deferred = None
        return [m.grad for group in self.param_groups for m in group["params"] if m.grad is not None]


    def step(self, closure: Callable[[], Any] | None = None, *,  # type: ignore[override]
             parts: Sequence[Sequence[Tensor]] | None = None,
             around: Callable[[int], contextlib.AbstractContextManager] | None = None,
             inputs: StepInputs | None = None) -> Any:
        """Step the masters and round them back into the model params.

        A ``closure`` is evaluated once (with grad enabled) before the grads are moved.

        ``inputs``: the precision side's device tensors (:class:`mixprec.optim.inputs.StepInputs`).
        With ``found_inf`` the step is skipped *on the device* where the flag is raised: the flat
        step (mixprec.optim.flat) issues its whole update and keeps the old values, bit for bit,
        without a host sync (after its first step: a skipped first step must create no state, so
        the flag is read on the host once); the per-master step (a step in parts and the other
        cases listed in flat's docstring) reads the flag on the host first, except where a
        torch ``fused=True`` inner optimizer steps params that are their own master (32-true,
        ``*-mixed``): it gets the flag and skips on the device (mixprec.optim.inputs).

        ``parts``: disjoint lists of *model* params; the step is then issued part by part (the
        inner optimizer over only that part's masters, then that part's copy-back), each inside
        ``around(i)`` (mixprec.optim.overlap puts part ``i`` on a side CUDA stream there). The
        state is the inner optimizer's own, shared, never copied; for an elementwise optimizer
        (mixprec.optim.parts.check_separable) the result is bit-identical to one whole step.
        Params in no part are not stepped.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self._grads_ready = False
        self._prepare_grads()
        params, masters = self._stepped
        found = inputs.found_inf if inputs is not None else None
        if parts is None and self._flat_ready():
            try:
                self._step_flat(found)
            finally:
                self._end_step()
            return loss
        self._leave_flat()
        # torch's fused inner optimizer (fused=True) skips on the device itself, given the flag
        # (mixprec.optim.inputs); else the per-master step reads the flag on the host first.
        on_device = found is not None and parts is None and not self._lo and _inputs.skips_on_device(self._inner)
        if found is not None and not on_device and bool(found.item() > 0):   # a host read
            self._narrow([m for m in self._masters if id(m) in self._wide], store=False)
            self._end_step()
            return loss
        try:
            if self._lo:
                self._step_split(parts, around)
            elif parts is None:
                if on_device:     # skipped: masters unchanged, so the copy-back rewrites the same bits
                    _inputs.step_skipping_on_device(self._inner, found)
                else:
                    self._inner.step()
                if params:
                    with torch.no_grad(), record_function("mixprec.master_copy_back"):
                        torch._foreach_copy_(params, masters)  # round-to-nearest into the model dtype
            else:
                self._step_parts(parts, around, {id(p) for p in params})
        finally:
            self._narrow([m for m in self._masters if id(m) in self._wide], store=False)
            self._end_step()
        return loss

    # ------------------------------------------------------------------ the flat step
    def _flat_members(self) -> list[list[tuple[Tensor, Tensor, str, Tensor | None, float | None]]]:
        """Per param group: (master, model param, kind, remainder, step count) of every trainable
        master, in order (frozen params have no grad: torch skips them, and so do the chunks).
        The step count (None: no state yet) keeps masters that stepped differently apart: a
        chunk shares one counter (read once here, when the chunks are made)."""
        out = []
        for group in self.param_groups:
            mems = []
            for m in group["params"]:
                p = self._model_of.get(id(m), m)
                if not p.requires_grad:
                    continue
                kind = "split" if self._is_split(m) else ("self" if p is m else "full")
                st = self.state.get(m)
                step = float(st["step"]) if st and isinstance(st.get("step"), Tensor) else None
                mems.append((m, p, kind, self._lo.get(id(m)), step))
            out.append(mems)
        return out

    def _make_twin(self, params: list[Tensor]) -> torch.optim.Optimizer:
        cls, kwargs = self._twin_args
        if getattr(self._inner, "quantized", False):   # FP32 moment scratch: the codes stay the inner's
            return cls(params, **{**kwargs, "moments": None, "moments_dtype": torch.float32,
                                  "stochastic_rounding": False, "seed": None})
        if "seed" in kwargs and getattr(self._inner, "_seed", None) is not None:
            kwargs = {**kwargs, "seed": self._inner._seed}   # the same rounding noise stream
        return cls(params, **kwargs)

    def _flat_ready(self) -> bool:
        """Whether this step runs flat (mixprec.optim.flat): an elementwise FP32 inner optimizer,
        every trainable master with a gradient (frozen ones without), plain tensors, no FP32
        copies widened by ``master_grads()``; prepares the chunks (made or made again, state
        adopted, ties packed) when it does."""
        if not self._flat_capable or self._wide:
            return False
        if not self._masters and _inputs.takes_found_inf(self._inner):
            # Only params that are their own master, and torch's fused kernel (fused=True) steps
            # them in one launch per (device, dtype) and skips on the device itself: flat chunks
            # would only add copies.
            return False
        if not self._masters and any(p.device.type != "cpu" for p in self._all_model_params):
            # Only FP32 params that are their own master (32-true, *-mixed): on an accelerator
            # torch's foreach/fused AdamW already steps them in a fixed number of launches, in
            # place; gathering them into flat chunks would only add three passes over memory.
            return False
        members = []
        for group in self.param_groups:
            for m in group["params"]:
                p = self._model_of.get(id(m), m)
                g = p.grad if self._is_split(m) else m.grad
                if not p.requires_grad:          # frozen: outside the chunks, unless given a grad
                    if g is not None:
                        return False
                    continue
                if g is None or p.dtype not in (torch.bfloat16, torch.float16, torch.float32) \
                        or (p is m and p.dtype != torch.float32) or _sharded.is_dtensor(p):
                    return False
                members.append(id(m))
        key = tuple(members)
        if self._flat is not None and self._flat.key != key:
            self._drop_flat()                    # params frozen or unfrozen: chunks made again
        for fresh in (self._flat is None, True):
            if self._flat is None:
                if not key:
                    return False
                coded = self._inner.moments if getattr(self._inner, "quantized", False) else None
                self._flat = FlatSteps(self._flat_members(), self._make_twin, self._inner, coded)
                self._flat.key = key
            self._flat.acquire()
            if all(chunk.synced or self._flat.adopt(chunk, self.state) for chunk in self._flat.chunks):
                break
            # Step counts diverged inside a chunk (a per-master step skipped some masters):
            # make the chunks again, grouped by step count; if even that fails, stay per master.
            self._drop_flat()
            if fresh:
                self._flat_capable = False
                return False
        assert self._flat is not None
        for chunk in self._flat.chunks:
            if chunk.split_idx and not chunk.ties_packed:
                self._pack_ties(chunk)
        return True

    def _flat_batches(self, low: list[Tensor]) -> list[tuple[list[int], list[Tensor]]] | None:
        """For the norms of deferred gradients (``split.DeferredGrads``): per chunk, positions of
        its split grads in ``low`` and their FP32 scratch views; None when this step is not flat."""
        if not self._flat_ready():
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

    @torch.no_grad()
    def _pack_ties(self, chunk: Any) -> None:
        """The per-master tie lists of ``chunk`` into its bitmap (once after a load or a
        per-master step: the lists are host-sized, the bitmap is not)."""
        chunk.flags.zero_()
        for i in chunk.split_idx:
            ties = self._ties[id(chunk.masters[i])]
            if ties.numel():
                chunk.flags[chunk.starts[i] + ties] = True
        pack_ties_(chunk.ties, chunk.flags, chunk.shifts)
        chunk.ties_packed = True

    @torch.no_grad()
    def _unpack_ties(self) -> None:
        """Bitmaps back into per-master tie lists, for the per-master paths (slow paths only)."""
        if self._flat is None:
            return
        for chunk in self._flat.chunks:
            if not chunk.ties_packed:
                continue
            flags = unpack_ties(chunk.ties, chunk.numel, chunk.shifts)
            for i in chunk.split_idx:
                a, n = chunk.starts[i], chunk.numels[i]
                self._ties[id(chunk.masters[i])] = flags[a:a + n].nonzero().squeeze(1)
            chunk.ties_packed = False

    def _leave_flat(self) -> None:
        """Before a per-master step: tie lists and per-master step counters back."""
        if self._flat is not None:
            self._unpack_ties()
            self._flat.unshare(self.state)

    def _drop_flat(self) -> None:
        """Forget the chunks (param groups changed, or a load replaced the state and masters)."""
        if self._flat is not None:
            self._leave_flat()
            self._flat = None

    def _step_flat(self, found_inf: Tensor | None = None) -> None:
        factors = self._deferred.factors if self._deferred is not None else []
        flat = self._flat
        assert flat is not None
        skips: dict[torch.device, Tensor] = {}
        if found_inf is not None and flat.stateless():
            # The first step: a skipped one must create no state (torch's meaning of "not
            # stepped"), so this once the host reads the flag first.
            if bool(found_inf.item() > 0):
                return
            found_inf = None
        if found_inf is not None:
            for dev in {c.param.device for c in flat.chunks}:
                skips[dev] = found_inf.to(dev, non_blocking=True) > 0     # stays on the device
        groups, inner = self.param_groups, self._inner
        # The inner optimizer's own step hooks still see one step (register_step_pre_hook on
        # ``optimizer.inner``), although its math now runs on the twin's flat tensors.
        for hook in list(inner._optimizer_step_pre_hooks.values()):
            hook(inner, (), {})
        flat.reseed()
        with record_function("mixprec.flat_step"):
            for chunk in flat.chunks:
                hyper = {k: v for k, v in groups[chunk.group].items() if k != "params"}
                flat.step_chunk(chunk, hyper, factors, self.state, skips.get(chunk.param.device))
        for hook in list(inner._optimizer_step_post_hooks.values()):
            hook(inner, (), {})

    def _end_step(self) -> None:
        if self._flat is not None:
            self._flat.release()              # the flat step's scratch holds no memory between steps
        self._grads_ready = False
        self._stepped = ([], [])
        self._pending = set()
        if self._deferred is not None:
            self._deferred.closed = True
            self._deferred = None


    def _step_parts(self, parts: Sequence[Sequence[Tensor]],
                    around: Callable[[int], contextlib.AbstractContextManager] | None,
                    stepped: set[int]) -> None:
        from mixprec.optim.parts import restricted_groups
        inner, whole = self._inner, self._inner.param_groups
        try:
            for i, part in enumerate(parts):
                masters = [self._master_of[id(p)] for p in part]
                with (around(i) if around is not None else contextlib.nullcontext()):
                    inner.param_groups = restricted_groups(whole, masters)
                    inner.step()
                    back = [p for p in part if id(p) in stepped and self._master_of[id(p)] is not p]
                    if back:
                        with torch.no_grad(), record_function("mixprec.master_copy_back"):
                            torch._foreach_copy_(back, [self._master_of[id(p)] for p in back])
        finally:
            inner.param_groups = whole

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the grads of the model params and of the masters."""
        self._narrow([m for m in self._masters if id(m) in self._wide], store=False)
        self._end_step()
        tensors = self._all_model_params + self._masters
        if set_to_none:
            for t in tensors:
                t.grad = None
            for buf in self._grad_of.values():   # FP32 master grads hold no memory between steps
                buf.untyped_storage().resize_(0)
            return
        grads = [t.grad for t in tensors if t.grad is not None]
        for t in tensors:
            if t.grad is not None and t.grad.grad_fn is not None:
                t.grad = t.grad.detach()
        if grads:
            with torch.no_grad():
                torch._foreach_zero_(grads)

    def __repr__(self) -> str:
        kind = f"{len(self._lo)} split" if self._lo else str(len(self._masters))
        return (f"{type(self).__name__}({type(self._inner).__name__}, {kind} masters in "
                f"{self.master_dtype}, {len(self._all_model_params)} params)")
