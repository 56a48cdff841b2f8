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
(mixprec.optim.split_masters, the arithmetic in mixprec.optim.split), 2 bytes instead of 4, and no FP32 master gradients are kept: the step widens
one bounded chunk of masters and BF16 gradients at a time, steps it with the inner optimizer and
splits it back, bit-identical to the FP32-master step. The loss-scale division and the clip
coefficient are deferred into that widening (``deferred_grads()``, used by mixprec's scaler and
``clip_grad_norm_``). ``master_grads()`` still works for other callers (``torch.amp.GradScaler``):
it widens everything for that step into FP32 tensors that stand in the param groups until the step. Gradient accumulation is unchanged: autograd sums
the micro-batches into the BF16 ``.grad``, exactly as with full masters.

The step itself is flat (:mod:`mixprec.optim.flat`): the masters of each param group and device
are stepped as a few flat FP32 chunks by a twin of the inner optimizer, a fixed number of ops
whatever the number of parameters, no host sync, and a non-finite step can be skipped on the device
(``step(inputs=StepInputs(found_inf=...))``, :mod:`mixprec.optim.inputs`). The per-master step
(``_step_per_master``: the inner optimizer over the masters; split masters widened chunk by chunk
into FP32 tensors of the inner optimizer's own, mixprec.optim.split_masters) is the fallback for what the flat step cannot do (see flat's docstring); both give the same bits.

The classes, one storage layout each, each whole in its own file (no mixins):
:class:`MasterWeights` here (full FP32 masters around any inner optimizer: what it stores, its
grads, its step, its checkpoint), :class:`mixprec.optim.split_masters.SplitMasterWeights` (the
same, with the masters of BF16 params stored split; ``MasterWeights(...)`` builds one wherever
split masters are exact) and :class:`mixprec.optim.AdamW` (mixprec's AdamW over the masters, with
BF16 or 8-bit moments). The flat step's chunks live in :mod:`mixprec.optim.flat`, the split
arithmetic in :mod:`mixprec.optim.split` (plain functions).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.profiler import record_function

from mixprec.errors import CheckpointError, ConfigError
from mixprec.optim import inputs as _inputs, registry, sharded as _sharded, split as _split
from mixprec.optim.flat import FlatSteps
from mixprec.optim.inputs import StepInputs

__all__ = ["MasterWeights", "STATE_KEY"]

STATE_KEY = "master_weights"
"""Where a ``MasterWeights`` state dict keeps its masters."""


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


class MasterWeights(torch.optim.Optimizer):
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
            table's ``master`` column (``Precision.layers.master_params(model)``; ``Precision.setup``
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

    ``MasterWeights(...)`` returns a :class:`mixprec.optim.split_masters.SplitMasterWeights`
    (a subclass) where split masters are on (``split``): that layout's storage, step and
    checkpoint live in its own file; this class holds full FP32 masters only.
    """

    _split_layout: type[MasterWeights] | None = None
    """The split-master layout's class (mixprec.optim.split_masters; it names itself with
    ``split_layout=True``, and ``import mixprec.optim`` imports it)."""

    def __init_subclass__(cls, *, split_layout: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if split_layout:
            MasterWeights._split_layout = cls

    def __new__(cls, optimizer_cls: Any = None, *args: Any, split: bool | None = None,
                master_dtype: torch.dtype = torch.float32, **kwargs: Any) -> MasterWeights:
        if cls is MasterWeights and cls._split_layout is not None and isinstance(optimizer_cls, type) \
                and issubclass(optimizer_cls, torch.optim.Optimizer) and isinstance(master_dtype, torch.dtype) \
                and master_dtype.is_floating_point and _split.resolve_split(split, optimizer_cls, master_dtype):
            cls = cls._split_layout
        return super().__new__(cls)

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
        self.split = self._resolve_split(split, optimizer_cls, master_dtype)
        # Pairs (model param, separate master); self-mastered params are not listed here.
        self._model_params: list[Tensor] = []
        self._masters: list[Tensor] = []
        self._master_of: dict[int, Tensor] = {}  # id(model param) -> master (separate or itself)
        self._all_model_params: list[Tensor] = []  # flat order of the param groups
        self._grads_ready = False
        self._stepped: tuple[list[Tensor], list[Tensor]] = ([], [])  # (model params, masters) to copy back
        self._model_of: dict[int, Tensor] = {}  # id(separate master) -> model param
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

    @staticmethod
    def _resolve_split(split: bool | None, optimizer_cls: type[torch.optim.Optimizer],
                       master_dtype: torch.dtype) -> bool:
        """Full masters: ``split=True`` is refused where it cannot be exact (``split.resolve_split``
        raises), else there is nothing to split in this layout."""
        if split:
            _split.resolve_split(split, optimizer_cls, master_dtype)
        return False

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
            # The one ``.data`` assignment left: the model, the user and their schedulers hold this
            # very Parameter, so its dtype must change in place; ``torch.utils.swap_tensors`` (the
            # other way to keep the object) refuses any tensor with a weak reference (weak-keyed
            # registries, torch.compile's guards), which ``.data`` does not care about.
            p.data = p.data.to(self.param_dtype)
            p.grad = None
        master = self._store_master(p, master)
        self._model_params.append(p)
        self._masters.append(master)
        self._model_of[id(master)] = p
        self._master_of[id(p)] = master
        return master

    def _store_master(self, p: Tensor, exact: Tensor) -> Tensor:
        """The master the inner optimizer steps for ``p``, given its exact value: here ``exact``
        itself (a full FP32 tensor); the split layout stores it differently."""
        return exact

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
        return 0

    def master_of(self, param: Tensor) -> Tensor:
        """The FP32 master of a model param (the param itself when it is already in the master
        dtype)."""
        try:
            return self._master_of[id(param)]
        except KeyError:
            raise ConfigError("this tensor is not one of the optimizer's parameters") from None

    def updates(self, param: Tensor) -> bool:
        """Whether ``param`` is one of the model params this optimizer steps (no copy made)."""
        return id(param) in self._master_of

    def step_grads(self, param: Tensor) -> list[Tensor]:
        """The gradient tensors the step reads for ``param``: its master's FP32 ``.grad``."""
        m = self._master_of.get(id(param))
        return [g for g in (m.grad if m is not None else None,) if g is not None]

    def deferred_grads(self) -> _split.DeferredGrads | None:
        """None: full masters defer nothing, their FP32 grads are ``master_grads()`` (split
        masters return the step's gradients here, mixprec.optim.split_masters)."""
        return None

    def _is_split(self, m: Tensor) -> bool:
        """Whether master ``m`` is stored split (never in this layout)."""
        return False

    @torch.no_grad()
    def _prepare_grads(self) -> None:
        """Once per step: copy the grads of full masters into their FP32 ``.grad`` (buffers
        allocated once), and note which masters the step reads (``_stepped``); a master whose
        model grad the step reads itself (``_reads_model_grad``: split ones) is only noted."""
        if self._grads_ready:
            return
        src, dst, stepped_params, stepped_masters, deferred = [], [], [], [], []
        for p, m in zip(self._model_params, self._masters):
            if p.grad is None:
                m.grad = None
                continue
            if p.grad.is_sparse:
                raise ConfigError("sparse gradients are not supported with master weights; "
                                  "use a dense embedding (sparse=False)")
            stepped_params.append(p)
            stepped_masters.append(m)
            if self._reads_model_grad(m):
                deferred.append(m)
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
        self._note_deferred(deferred)
        self._grads_ready = True

    def _reads_model_grad(self, m: Tensor) -> bool:
        """Whether the step reads the model param's own grad for master ``m`` (no FP32 copy)."""
        return False

    def _note_deferred(self, masters: list[Tensor]) -> None:
        """The masters of this step whose model grads the step reads itself (none here)."""

    @torch.no_grad()
    def master_grads(self) -> list[Tensor]:
        """Copy low-precision model grads into the masters' FP32 ``.grad``; return all master grads.

        The returned tensors are the ones ``step()`` will use: unscale, check or clip them in
        place. The copy happens once per step; later calls return the same tensors without copying
        again, until ``step()`` or ``zero_grad()``. Params whose grad is ``None`` are left out (and
        their master's grad is set to ``None`` so the inner optimizer skips them).
        """
        self._prepare_grads()
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

        The whole step, in order: the grads (``_prepare_grads``); the flat step when it applies
        (``_flat_ready``; mixprec.optim.flat), else the per-master step (``_step_per_master``);
        the step's transient memory dropped (``_end_step``).
        """
        loss = None
        if self._flat is not None:
            self._flat.settle()            # counters of a step skipped on the device (flat.settle)
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self._grads_ready = False
        self._prepare_grads()
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
        on_device = found is not None and parts is None and not self.split_count \
            and _inputs.skips_on_device(self._inner)
        try:
            if found is not None and not on_device and bool(found.item() > 0):   # a host read
                return loss
            self._step_per_master(parts, around, found if on_device else None)
        finally:
            self._end_step()
        return loss

    def _step_per_master(self, parts: Sequence[Sequence[Tensor]] | None,
                         around: Callable[[int], contextlib.AbstractContextManager] | None,
                         found_on_device: Tensor | None) -> None:
        """The inner optimizer over the masters themselves (whole, or a view per part), then the
        copy-back into the model params."""
        params, masters = self._stepped
        if parts is not None:
            self._step_parts(parts, around, {id(p) for p in params})
            return
        if found_on_device is not None:   # skipped: masters unchanged, so the copy-back rewrites the same bits
            _inputs.step_skipping_on_device(self._inner, found_on_device)
        else:
            self._inner.step()
        if params:
            with torch.no_grad(), record_function("mixprec.master_copy_back"):
                torch._foreach_copy_(params, masters)  # round-to-nearest into the model dtype

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
                mems.append((m, p, kind, self._remainder_of(m), step))
            out.append(mems)
        return out

    def _remainder_of(self, m: Tensor) -> Tensor | None:
        """The int16 remainder of a split master (none in this layout)."""
        return None

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
        if not self._flat_capable or self._widened():
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
        self._enter_flat(self._flat)
        return True

    def _widened(self) -> bool:
        """Whether some master holds FP32 values made for this step only (split masters widened
        by ``master_grads()``); never in this layout."""
        return False

    def _enter_flat(self, flat: FlatSteps) -> None:
        """Before a flat step: what the chunks need from this layout's per-master form (nothing)."""

    def _leave_flat(self) -> None:
        """Before a per-master step: per-master step counters back (the chunks share one)."""
        if self._flat is not None:
            self._flat.unshare(self.state)

    def _drop_flat(self) -> None:
        """Forget the chunks (param groups changed, or a load replaced the state and masters)."""
        if self._flat is not None:
            self._leave_flat()
            self._flat = None

    def _step_flat(self, found_inf: Tensor | None = None) -> None:
        factors = self._grad_factors()
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

    def _grad_factors(self) -> list[Tensor]:
        """Pending FP32 multipliers of the grads the step reads from the model (none here)."""
        return []

    def _end_step(self) -> None:
        """After a step (taken or skipped) or ``zero_grad``: the step's transient memory goes."""
        if self._flat is not None:
            self._flat.release()              # the flat step's scratch holds no memory between steps
        self._grads_ready = False
        self._stepped = ([], [])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the grads of the model params and of the masters."""
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

    # ------------------------------------------------------------------ the checkpoint
    @torch.no_grad()
    def sync_masters_from_model(self) -> None:
        """Overwrite the masters with the model params (after loading model weights only)."""
        self._drop_flat()
        full = [(m, p) for p, m in zip(self._model_params, self._masters) if not self._is_split(m)]
        if full:
            torch._foreach_copy_([m for m, _ in full], [p for _, p in full])

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus the masters (by flat param index), in FP32.

        Like torch's, the returned tensors are references, not copies (split masters are joined
        into fresh FP32 tensors, so the file is the same with and without split masters). Everything
        in it loads with ``torch.load(..., weights_only=True)``.
        """
        if self._flat is not None:
            self._flat.settle()
        sd = self._inner.state_dict()
        # The flat step's per-master state views share one step counter per chunk
        # (mixprec.optim.flat): save each its own, as torch's optimizers do.
        sd["state"] = {i: {k: (v.clone() if isinstance(v, torch.Tensor) and v.dim() == 0 else v)
                           for k, v in st.items()} for i, st in sd["state"].items()}
        index = {id(p): i for i, p in enumerate(self._all_model_params)}
        sd[STATE_KEY] = {
            "dtype": str(self.master_dtype).removeprefix("torch."),
            "index": [index[id(p)] for p in self._model_params],
            "tensors": self.masters,
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the inner state and the masters, and round the masters into the model params.

        A plain torch optimizer state dict (no masters in it) also loads: the masters are then
        left as they are (call ``sync_masters_from_model()`` after loading the model weights).
        """
        sd = dict(state_dict)
        saved = sd.pop(STATE_KEY, None)
        self.zero_grad()
        self._drop_flat()        # new state and masters: the chunks adopt them at the next step
        try:
            self._inner.load_state_dict(sd)
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"optimizer state does not match this optimizer ({exc}); load it into "
                                  "an optimizer built over the same parameters in the same order") from None
        self._alias_inner()
        self._grads_ready = False
        if saved is None:
            return
        n = len(self._all_model_params)
        tensors, index = saved["tensors"], saved["index"]
        if len(tensors) != len(index) or any(not 0 <= i < n for i in index):
            raise CheckpointError("the saved master weights index params this optimizer does not have; "
                                  "load the checkpoint into an optimizer over the same model")
        dst_masters, src, model_params = [], [], []
        with torch.no_grad():
            for i, t in zip(index, tensors):
                p = self._all_model_params[i]
                if t.shape != p.shape:
                    raise CheckpointError(f"saved master #{i} has shape {tuple(t.shape)} but the param has "
                                          f"{tuple(p.shape)}; load the checkpoint into the same model architecture")
                m = self._master_of[id(p)]
                if self._load_master(p, m, t):
                    continue
                dst_masters.append(m)
                src.append(t)
                if m is not p:
                    model_params.append(p)
            if not dst_masters:
                return
            torch._foreach_copy_(dst_masters, src)
            if model_params:
                torch._foreach_copy_(model_params, [self._master_of[id(p)] for p in model_params])

    def _load_master(self, p: Tensor, m: Tensor, saved: Tensor) -> bool:
        """Load a saved FP32 master the layout stores its own way; False: a plain copy does."""
        return False

    def __repr__(self) -> str:
        kind = f"{self.split_count} split" if self.split_count else str(len(self._masters))
        return (f"{type(self).__name__}({type(self._inner).__name__}, {kind} masters in "
                f"{self.master_dtype}, {len(self._all_model_params)} params)")
