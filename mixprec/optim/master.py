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

The classes, one storage layout each: :class:`MasterWeights` here (full FP32 masters around any
inner optimizer: the torch optimizer it is, its public calls, the step read top to bottom),
:class:`mixprec.optim.split_masters.SplitMasterWeights` (the same, with the masters of BF16 params
stored split; ``MasterWeights(...)`` builds one wherever split masters are exact) and
:class:`mixprec.optim.AdamW` (mixprec's AdamW over the masters, with BF16 or 8-bit moments). What
they are composed of, one module each: which param has which master and how it is stored
(:mod:`mixprec.optim.master_table`, the split storage in split_masters), the masters' FP32 grads
(:mod:`mixprec.optim.master_grads`), the per-master reference step
(:mod:`mixprec.optim.per_master`), the dispatch to the flat step
(:mod:`mixprec.optim.flat_dispatch`; the chunks themselves in :mod:`mixprec.optim.flat`), the
checkpoint (:mod:`mixprec.optim.master_checkpoint`), the arguments
(:mod:`mixprec.optim.master_args`), the split arithmetic (:mod:`mixprec.optim.split`).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from mixprec.errors import ConfigError
from mixprec.optim import flat_dispatch, master_checkpoint, per_master, registry
from mixprec.optim import split as _split
from mixprec.optim.flat import FlatSteps
from mixprec.optim.inputs import StepInputs
from mixprec.optim.master_args import check_master_args, normalise_groups
from mixprec.optim.master_checkpoint import STATE_KEY
from mixprec.optim.master_table import Masters

__all__ = ["MasterWeights", "STATE_KEY"]


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
            (the module docstring). ``None`` (default): wherever exact (``split.resolve_split``:
            FP32 masters, an elementwise inner optimizer); ``True`` refuses other optimizers;
            ``False`` keeps full FP32 masters (the user's flag; the layout classes need none).
        layout: the layout by its class, ``MasterWeights`` (full) or ``SplitMasterWeights`` (split
            wherever exact), whose storage is used as is (``Precision`` passes it from
            ``recipe.masters``). ``None``: this class (``MasterWeights`` for ``split=False``).
        master_params: the parameters that get a separate FP32 master, exactly these: the per-layer
            table's ``master`` column (``Precision.layers.master_params(model)``); listed FP32
            params are converted to ``param_dtype``, unlisted ones are their own master. ``None``
            (a hand-built optimizer): decided by dtype (``mixprec.optim.master_table.Masters``).

    It *is* a ``torch.optim.Optimizer`` (so LR schedulers accept it): ``param_groups`` and
    ``state`` are the inner optimizer's own objects, holding the masters, so editing
    ``param_groups[i]["lr"]`` reaches the inner optimizer. Params with ``requires_grad=False`` or
    without a grad are skipped by ``step()`` like torch does; they still get a master, so pass
    only trainable params if frozen ones are large.

    ``MasterWeights(...)`` returns a :class:`mixprec.optim.split_masters.SplitMasterWeights`
    (a subclass) where split masters are on (``split``): that layout's storage, step and
    checkpoint live in its own file; this class holds full FP32 masters only."""

    _table_cls: type[Masters] = Masters     # how this layout stores masters (master_table): full

    _split_layout: type[MasterWeights] | None = None   # SplitMasterWeights (``split_layout=True``)

    def __init_subclass__(cls, *, split_layout: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if split_layout:
            MasterWeights._split_layout = cls

    def __new__(cls, optimizer_cls: Any = None, *args: Any, split: bool | None = None,
                layout: type[MasterWeights] | None = None,
                master_dtype: torch.dtype = torch.float32, **kwargs: Any) -> MasterWeights:
        if cls is MasterWeights:   # the layout said (Precision), else the user's flag decides
            cls = layout or (cls._split_layout if cls._split_layout is not None and
                             _split.split_layout_applies(optimizer_cls, split, master_dtype) else cls)
        return super().__new__(cls)

    def __init__(
        self,
        optimizer_cls: type[torch.optim.Optimizer],
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        *,
        master_dtype: torch.dtype = torch.float32,
        param_dtype: torch.dtype | None = None,
        split: bool | None = None,
        layout: type[MasterWeights] | None = None,
        master_params: Iterable[Tensor] | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        check_master_args(optimizer_cls, master_dtype, param_dtype, split=split, layout=layout)
        if layout is None:
            layout = MasterWeights if split is False else type(self)
        if not isinstance(self, layout):
            raise ConfigError(f"{type(self).__name__} cannot step the {layout.__name__} layout; use {layout.__name__}")
        self.master_dtype, self.param_dtype = master_dtype, param_dtype
        wanted = None if master_params is None else {id(p) for p in master_params}
        # The flat step (mixprec.optim.flat) needs an elementwise inner optimizer on FP32 masters:
        # one call over a concatenation must give each element what the per-master call gave.
        self._flat_capable = _split.chunk_exact(optimizer_cls) and master_dtype == torch.float32
        self._table = layout._table_cls(master_dtype, param_dtype, wanted, elementwise=self._flat_capable)
        self._twin_args = (optimizer_cls, dict(optimizer_kwargs))
        self._flat: FlatSteps | None = None     # built at the first flat step (mixprec.optim.flat)

        master_groups = [self._table.make_group(g) for g in normalise_groups(params)]
        self._inner = optimizer_cls(master_groups, **optimizer_kwargs)
        self._constructing = True
        super().__init__(self._inner.param_groups, self._inner.defaults)
        self._constructing = False
        self._alias_inner()
        registry.remember(self, self._table.all_params)

    # the storage's answers: split or not; id(model param) -> its master; the FP32 grad buffers
    split = property(lambda self: self._table.split)
    _master_of = property(lambda self: self._table.master_of)
    _grad_of = property(lambda self: self._table.grad_of)

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
        (group,) = normalise_groups([param_group])
        self._inner.add_param_group(self._table.make_group(group))
        self._alias_inner()
        flat_dispatch.drop(self)

    # ------------------------------------------------------------------ public API
    @property
    def inner(self) -> torch.optim.Optimizer:
        """The optimizer that steps the masters."""
        return self._inner

    @property
    def masters(self) -> list[Tensor]:
        """The separate masters (one per low-precision param), in param-group order. A split
        master is joined into a fresh FP32 tensor (a copy: writing to it changes nothing)."""
        return [self.master_of(p) for p in self._table.model_params]

    @property
    def split_count(self) -> int:
        """How many parameters keep a split master (the parameter + a 16-bit remainder)."""
        return self._table.split_count

    def master_of(self, param: Tensor) -> Tensor:
        """The FP32 master of a model param (the param itself when already in the master dtype)."""
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

    @torch.no_grad()
    def master_grads(self) -> list[Tensor]:
        """Copy low-precision model grads into the masters' FP32 ``.grad``; return all master
        grads: the tensors ``step()`` will use (unscale, check or clip them in place). Copied once
        per step, until ``step()`` or ``zero_grad()``. Params whose grad is ``None`` are left out
        (their master's grad is set to ``None`` so the inner optimizer skips them)."""
        self._table.prepare_grads()
        return [m.grad for group in self.param_groups for m in group["params"] if m.grad is not None]

    def step(self, closure: Callable[[], Any] | None = None, *,  # type: ignore[override]
             parts: Sequence[Sequence[Tensor]] | None = None,
             around: Callable[[int], contextlib.AbstractContextManager] | None = None,
             inputs: StepInputs | None = None) -> Any:
        """Step the masters and round them back into the model params.

        A ``closure`` is evaluated once (with grad enabled) before the grads are moved.

        ``inputs``: the precision side's device tensors (:class:`mixprec.optim.inputs.StepInputs`).
        With ``found_inf`` the step is skipped *on the device* where the flag is raised: the flat
        step issues its whole update and keeps the old values, bit for bit, without a host sync
        (after its first step); the per-master step reads the flag on the host first, except for
        a torch ``fused=True`` inner optimizer over params that are their own master (the cases:
        mixprec.optim.flat_dispatch.step_masters).

        ``parts``: disjoint lists of *model* params; the step is then issued part by part (the
        inner optimizer over only that part's masters, then that part's copy-back), each inside
        ``around(i)`` (mixprec.optim.overlap puts part ``i`` on a side CUDA stream there). The
        state is the inner optimizer's own, shared, never copied; for an elementwise optimizer
        (mixprec.optim.parts.check_separable) the result is bit-identical to one whole step.
        Params in no part are not stepped.
        """
        loss = None
        flat_dispatch.settle(self)        # counters of a step skipped on the device (flat.settle)
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self._table.grads_ready = False
        self._table.prepare_grads()
        flat_dispatch.step_masters(self, inputs, parts, around)
        return loss

    def _step_per_master(self, parts: Sequence[Sequence[Tensor]] | None,
                         around: Callable[[int], contextlib.AbstractContextManager] | None,
                         found_on_device: Tensor | None) -> None:
        """The inner optimizer over the masters themselves (whole, or a view per part), then the
        copy-back into the model params (mixprec.optim.per_master)."""
        params, masters = self._table.stepped
        if parts is None:
            per_master.step_whole(self._inner, params, masters, found_on_device)
        else:
            per_master.step_parts(self._inner, parts, around, self._master_of, {id(p) for p in params})

    # ------------------------------------------------------------------ the flat step
    def _make_flat(self) -> FlatSteps:
        """The flat step's chunks over this step's trainable masters (mixprec.optim.flat)."""
        coded = self._inner.moments if getattr(self._inner, "quantized", False) else None
        twin = functools.partial(flat_dispatch.make_twin, *self._twin_args, self._inner)
        return FlatSteps(flat_dispatch.members(self), twin, self._inner, coded)

    def _grad_factors(self) -> list[Tensor]:
        """Pending FP32 multipliers of the grads the step reads from the model (none here)."""
        return []

    def _end_step(self) -> None:
        """After a step (taken or skipped) or ``zero_grad``: the step's transient memory goes."""
        if self._flat is not None:
            self._flat.release()              # the flat step's scratch holds no memory between steps
        self._table.end_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the grads of the model params and of the masters."""
        self._end_step()
        self._table.zero_grads(set_to_none)

    # ------------------------------------------------------------------ the checkpoint
    @torch.no_grad()
    def sync_masters_from_model(self) -> None:
        """Overwrite the masters with the model params (after loading model weights only)."""
        flat_dispatch.drop(self)
        self._table.sync_from_model()

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus the masters (by flat param index), in FP32:
        references, not copies, as torch's; the same file with and without split masters;
        loads with ``torch.load(..., weights_only=True)`` (mixprec.optim.master_checkpoint)."""
        flat_dispatch.settle(self)
        return master_checkpoint.save(self._inner, self.master_dtype, self._table.all_params,
                                      self._table.model_params, self.masters)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the inner state and the masters, and round the masters into the model params. A
        plain torch optimizer state dict (no masters in it) also loads: the masters are then left
        as they are (call ``sync_masters_from_model()`` after loading the model weights)."""
        self.zero_grad()
        flat_dispatch.drop(self)        # new state and masters: the chunks adopt them at the next step
        master_checkpoint.load(self._inner, self._table, state_dict)
        self._alias_inner()

    def __repr__(self) -> str:
        kind = f"{self.split_count} split" if self.split_count else str(len(self._table.masters))
        return (f"{type(self).__name__}({type(self._inner).__name__}, {kind} masters in "
                f"{self.master_dtype}, {len(self._table.all_params)} params)")
