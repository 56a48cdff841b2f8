"""`Precision`: the public face of a run's precision, a thin composition of recipe + plugins.

Every choice is the frozen :class:`~mixprec.precision.recipe.Recipe` it is built from
(:attr:`Precision.recipe`, fixed at construction: its dtypes, ``keeps_masters``, ``masters``,
``scales_loss``, ...). The small plugins of :mod:`mixprec.precision.plugins` apply it, one per
family; ``Precision`` calls them and runs the step itself:

==========================  =====================================================================
what                        who
==========================  =====================================================================
every layer, in one table   :attr:`Precision.layers` (:class:`~mixprec.precision.layers.Layers`):
                            :meth:`resolve` / :meth:`describe` (model), each Linear's live
                            format; what each layer is: the rule book, :mod:`.rules`
storage dtypes, masters     ``ParamsPlugin``: the cast (:meth:`Layers.param_dtype_for`), the
and moments                 optimizer from ``recipe.masters`` / ``recipe.moments``
                            (:meth:`setup_optimizer`, :meth:`make_optimizer`)
each Linear's format        ``FormatsPlugin``: FP8 / micro / 16-32-bit layers swapped at
(FP8, micro formats)        :meth:`setup` (:meth:`Layers.format_for`, first override wins)
the forward's dtype         ``AutocastPlugin``: :meth:`autocast`, :meth:`convert_output`
loss scaling                the one plugin whose family scales (:meth:`scale_loss`,
                            :meth:`backward`); :meth:`step` unscales and updates :attr:`scaler`
FSDP2                       ``Fsdp2Plugin``: cast before sharding or not, the sharded
                            optimizer, the units' ``MixedPrecisionPolicy`` (strategies/fsdp.py)
the step                    :meth:`Precision.step`, here, the same for every family
==========================  =====================================================================

A hand-written loop and :func:`mixprec.train.fit` use the same object, so they cannot drift::

    precision = mixprec.Precision("bf16-mixed")
    model, optimizer = precision.setup(model, optimizer)
    for x, y in loader:
        with precision.autocast():
            loss = loss_fn(model(x), y)
        precision.backward(loss)
        precision.step(optimizer, clip_grad_norm=1.0)   # unscale, check, clip, step or skip
        optimizer.zero_grad()
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd.profiler import record_function

from mixprec import _moved
from mixprec.amp import GradScaler
from mixprec.amp.clip import clip_grads_
from mixprec.amp.grads import HasDeferredGrads, HasMasterGrads
from mixprec.errors import CheckpointError, ConfigError
from mixprec.optim import MasterWeights
from mixprec.optim.inputs import StepInputs, skips_on_device, step_skipping_on_device
from mixprec.policy import hardware
from mixprec.policy.overrides import check_patterns, normalize_overrides
from mixprec.policy.policy import Policy
from mixprec.precision.layers import Layers
from mixprec.precision.plugins import plugins_for
from mixprec.precision.recipe import Recipe
from mixprec.precision.table import LayerTable

if TYPE_CHECKING:
    from mixprec.optim.overlap import OverlappedUpdate

__all__ = ["Precision", "OptimizerSpec", "StepTaken", "prepare_fp8", "identity", "setup_identity",
           "forget_setup"]

OptimizerSpec = torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None
"""An optimizer over the model's parameters, a factory ``params -> optimizer``, or None."""

_SETUP_TAG = "_mixprec_precision"


class StepTaken:
    """What :meth:`Precision.step` returns: whether the optimizer step was taken, usable as the
    ``bool`` it used to be (``if precision.step(opt):``, ``not taken``, ``taken == True``). For a
    step skipped on the device the truth is the non-finite flag, still on the device: it is read
    (one host read, remembered) the first time it is asked for, never by ``Precision.step``."""

    __slots__ = ("_found", "_value", "_resolve", "__weakref__")

    def __init__(self, found_inf: torch.Tensor | None, value: bool | None = None,
                 resolve: Callable[[], None] | None = None) -> None:
        # ``resolve``: the scaler's, which reads this flag with everything queued in one read
        # (and sets ``_value``), so that the counters and the scale asked for next cost nothing.
        self._found, self._value, self._resolve = found_inf, value, resolve

    @property
    def known(self) -> bool:
        """Whether the value is on the host already (asking for it costs no read)."""
        return self._value is not None

    @property
    def found_inf(self) -> torch.Tensor | None:
        """The device flag (> 0: skipped), or None when the value was decided on the host."""
        return self._found

    def __bool__(self) -> bool:
        if self._value is None and self._resolve is not None:
            self._resolve()
        if self._value is None:
            self._value = not bool(self._found.item() > 0)     # the one read, when asked
        return self._value

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (bool, StepTaken)):
            return bool(self) == bool(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(bool(self))

    def __repr__(self) -> str:
        return repr(self._value) if self._value is not None else "StepTaken(<on the device>)"


class _Face(type):
    """``Precision``'s type: a member retired in 0.4 named on the class (a static method once)
    says where it went, as on an instance."""

    def __getattr__(cls, name: str) -> Any:
        _moved.refuse_member(cls, name)


class Precision(metaclass=_Face):
    """The precision of a run: its frozen recipe, applied by the plugins, and the step.

    Args:
        precision: a ready :class:`~mixprec.precision.recipe.Recipe` (which holds every other
            choice: pass none of them with it), or what :meth:`Recipe.build` takes to build one: a
            preset name (``"bf16-mixed"``), an alias, the compact form (``"p=f32,c=bf16,o=f32"``),
            ``True``/``"auto"`` (best safe mode for ``device``), ``plan:PATH`` or a ``Policy``,
            with ``overrides``, ``micro_options``, ``optimizer`` (one storing 16-bit parameters
            decides ``auto``), ``split_masters``, ``moments``, ``fp8_activations`` and the loss
            scaler's ``**scaler_options`` (scaling is on only where the mode needs it, FP16; the
            non-finite check and skip are always on).
        device: where the model runs (default: the model's device at :meth:`setup`, else CUDA when
            available, else CPU); decides ``auto`` and the autocast device type.
    """

    def __init__(self, precision: str | Policy | Recipe | bool | None = "auto", *,
                 device: torch.device | str | None = None, overrides: Any = None,
                 micro_options: Any = None, optimizer: torch.optim.Optimizer | None = None,
                 split_masters: bool = True, moments: str = "fp32", fp8_activations: bool = False,
                 **scaler_options: Any) -> None:
        self.device = torch.device(device) if device is not None else hardware.default_device()
        self._recipe = recipe = _recipe_of(
            precision, device=self.device, overrides=overrides, micro_options=micro_options,
            optimizer=optimizer, split_masters=split_masters, moments=moments,
            fp8_activations=fp8_activations, **scaler_options)
        self._plugins = plugins_for(recipe)
        self._scaler: GradScaler | None = None   # built on first use: cheap questions need none
        self.notes: list[str] = list(recipe.notes)
        """What building the recipe and :meth:`setup` chose on the user's behalf, for the run log."""
        self.layers = Layers(recipe)
        """Every per-layer question, and the live formats of the model :meth:`setup` set up
        (:class:`~mixprec.precision.layers.Layers`)."""

    @property
    def scaler(self) -> GradScaler:
        """The loss scaler of the step (disabled unless the mode scales), built on first use."""
        if self._scaler is None:
            self._scaler = GradScaler(enabled=self.recipe.scales_loss, **self.recipe.scaler_options)
        return self._scaler

    @property
    def recipe(self) -> Recipe:
        """Every precision choice of this run (:class:`~mixprec.precision.recipe.Recipe`), fixed
        when this object was built: no mode changes afterwards."""
        return self._recipe

    @property
    def policy(self) -> Policy:
        """The recipe's policy: the dtypes, formats, exemptions and per-layer overrides."""
        return self._recipe.policy

    # ------------------------------------------------------------------ the decisions

    @property
    def name(self) -> str:
        """The mode's name (the compact form for a custom policy)."""
        return self.recipe.name

    def resolve(self, model: nn.Module) -> LayerTable:
        """Every decision for ``model``, one row per parameter-owning module (:meth:`Layers.resolve`)."""
        return self.layers.resolve(model)

    def describe(self, model: nn.Module | None = None) -> str:
        """With ``model``: its per-layer table, to print; without: one line for logs (:meth:`Layers.describe`)."""
        return self.layers.describe(model)

    def __repr__(self) -> str:
        return f"Precision({self.name!r})"

    def __getattr__(self, name: str) -> Any:
        _moved.refuse_member(Precision, name)     # members retired in 0.4 say where they went

    def __str__(self) -> str:
        return self.name

    # ------------------------------------------------------------------ set-up

    def setup(self, model: nn.Module, optimizer: OptimizerSpec = None,
              ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """Apply this mode to ``model`` (in place) and return ``(model, optimizer)``.

        Stores parameters in the mode's dtype (FP32 exemptions kept), swaps eligible Linear layers
        for FP8 ones in ``fp8-*`` modes, and gives 16-bit parameters FP32 master weights by
        wrapping ``optimizer`` in :class:`mixprec.optim.MasterWeights` (or building it, when
        ``optimizer`` is a factory ``params -> optimizer``). Idempotent: a second call with the same
        mode returns the same objects; another mode is refused.
        """
        built = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        self.recipe.check_optimizer(built)
        model = self.setup_module(model, optimizer=built)
        return model, self.setup_optimizer(optimizer, model)

    def setup_module(self, model: nn.Module, *, sharded: bool = False,
                     optimizer: torch.optim.Optimizer | None = None) -> nn.Module:
        """The plugins' module conversion, in place: storage dtypes (FP32 exemptions kept), then
        each Linear's format. ``sharded``: FSDP2 will shard the model, and its FP32 shards are the
        masters (cast only modes without masters). ``optimizer``: one that already converted
        parameters (``fp16_params=True``); FP32-exempt ones get their exact FP32 master values back."""
        done, mine = setup_identity(model), identity(self.policy)
        if done is not None:
            if done != mine:
                raise ConfigError(f"this model was already set up for precision {done}; build a "
                                  f"new model to train it in {mine}")
            return model
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        if self.policy.plan is not None:        # a plan file made for another model: refused
            self.policy.plan.check(linears)
        check_patterns(self.policy.overrides, linears)
        first = next(model.parameters(), None)
        if first is not None:
            self.device = first.device
        for plugin in self._plugins.converting(sharded=sharded):   # storage, then formats
            model = plugin.convert_module(self, model, optimizer=optimizer)
        setattr(model, _SETUP_TAG, mine)
        self.layers.table = self.layers.resolve(model)
        return model

    def setup_optimizer(self, optimizer: OptimizerSpec, model: nn.Module, *,
                        sharded: bool = False) -> torch.optim.Optimizer | None:
        """The optimizer this mode needs: ``optimizer`` itself (a factory ``params -> optimizer``
        is called first), or wrapped in FP32 masters (the params plugin; FSDP2's shards are the
        masters already)."""
        if optimizer is None:
            return None
        if not isinstance(optimizer, torch.optim.Optimizer):
            if not callable(optimizer):
                raise ConfigError(f"optimizer must be a torch optimizer or a factory params -> "
                                  f"optimizer, not {type(optimizer).__name__}")
            optimizer = optimizer([p for p in model.parameters() if p.requires_grad])
        return self._plugins.optimizing(sharded=sharded).setup_optimizer(self, optimizer, model)

    def make_optimizer(self, param_groups: list[dict[str, Any]], *, sharded: bool = False,
                       split_masters: bool | None = None, moments: str | None = None,
                       model: nn.Module | None = None,
                       **adamw_options: Any) -> torch.optim.Optimizer:
        """The default AdamW for this mode, built by the params plugin from ``recipe.masters`` and
        ``recipe.moments`` (:class:`~mixprec.precision.plugins.ParamsPlugin`: fused on CUDA where no
        parameter has a separate master) or, ``sharded``, by the FSDP2 plugin. ``model``: masters
        exactly for the table's set (:meth:`Layers.master_params`). ``split_masters`` and ``moments``
        default to the recipe's; others are checked as the recipe checks them."""
        plugins = self._plugins
        if (split_masters, moments) != (None, None):
            plugins = plugins_for(self.recipe.replace(
                split_masters=self.recipe.split_masters if split_masters is None else split_masters,
                moments=self.recipe.moments if moments is None else moments))
        return plugins.optimizing(sharded=sharded).make_optimizer(self, param_groups, model=model,
                                                                   **adamw_options)

    # ------------------------------------------------------------------ the step

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's context: matmuls in the compute dtype (FP32 means autocast off)."""
        return self._plugins.forward_context(self.device.type)

    def convert_output(self, x: Any) -> Any:
        """Cast a floating output tensor to the mode's output dtype (others pass through)."""
        return self._plugins.convert_output(x)

    def scale_loss(self, loss: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
        """``loss`` multiplied by the loss scale when the mode scales (FP16), else ``loss``: for a
        framework that calls ``backward`` itself (the Lightning plugin). ``scale``: an earlier
        step's scale instead (the non-finite replay)."""
        with record_function("mixprec.scale_loss"):
            return self._plugins.scale_loss(loss, self.scaler, scale=scale)

    def backward(self, loss: torch.Tensor, *, scale: float | None = None) -> None:
        """``loss.backward()``, multiplied by the loss scale when the mode scales (FP16).
        ``scale``: replay an earlier step at the scale it used (the non-finite trace)."""
        self.scale_loss(loss, scale=scale).backward()

    def step(self, optimizer: torch.optim.Optimizer, *, clip_grad_norm: float | None = None,
             measure_grad_norm: bool = False, overlap: OverlappedUpdate | None = None) -> bool | StepTaken:
        """Finish an optimizer step (issue #35's protocol, the same for every family): unscale once
        (fused with the inf/NaN check, agreed across ranks), clip the unscaled gradients to
        ``clip_grad_norm`` (or only measure them, ``measure_grad_norm``; ``scaler.last_grad_norm``),
        update the loss scale, then step (FP32 masters copied back) or skip the whole step.

        This is the one place that hands data between amp/ and optim/: the optimizer is asked for
        its gradients here (the grad protocol), the scaler and the clip get them as tensors, and
        the step gets the flag, the deferred unscale factor (a snapshot, untouched by the update)
        and the clip coefficient as device tensors in ``StepInputs``; one step visits amp/ in one
        stretch and optim/ around it (tests/precision/test_step_rooms.py).

        A mixprec master-weight optimizer gets the non-finite flag as a device tensor
        (:class:`~mixprec.optim.inputs.StepInputs`), torch's ``fused=True`` Adam/AdamW/SGD/Adagrad
        as its ``found_inf`` (from its second step on); both skip on the device, the scale moves
        there too, and the host reads nothing: the return value is a :class:`StepTaken`, whose
        truth (like ``scaler.num_skipped_steps``, ``scaler.get_scale()``) is read when asked, one
        read for everything queued. Any other optimizer, or ``overlap`` (an
        :class:`~mixprec.optim.overlap.OverlappedUpdate`: a taken step issued per module on a side
        stream, bit-identical), reads the flag on the host first and returns a ``bool``."""
        # 1. optim/: what the step needs from the optimizer, asked here once (the grad protocol)
        masters = isinstance(optimizer, MasterWeights)
        on_device = overlap is None and (masters or skips_on_device(optimizer))
        asked = _StepGrads.of(optimizer)
        # 2. amp/: unscale and check, clip, the scale's update; the scaler is handed tensors
        scaler = self.scaler
        with record_function("mixprec.unscale"):           # fused with the inf/NaN check
            inv_scale = scaler.unscale_(optimizer, asked.grads, low=asked.low)
        scaler.last_grad_norm = clip_coef = None
        if clip_grad_norm or measure_grad_norm:            # clip sees unscaled gradients
            with record_function("mixprec.clip_grad_norm"):
                scaler.last_grad_norm, clip_coef = clip_grads_(
                    optimizer, clip_grad_norm or math.inf, grads=asked.grads, low=asked.low,
                    order=asked.order, factors=[inv_scale] if inv_scale is not None else [],
                    batches=asked.batches)
        found = scaler.found_inf(optimizer) if on_device else None
        if found is not None:
            scaler.stepped_on_device(optimizer)            # no host read: the flag stays queued
            scaler.update()                                # the scale moves on the device
            taken = StepTaken(found, resolve=scaler.resolve)   # read only if the caller asks
            scaler.tell_when_read(found, taken)
            # 3. optim/: the step, with everything it needs (skipped on the device when found > 0)
            with record_function("mixprec.optimizer_step"):
                if masters:
                    optimizer.step(inputs=StepInputs(found_inf=found, inv_scale=inv_scale,
                                                     clip_coef=clip_coef))
                else:                                      # torch's fused=True: as torch hands it
                    step_skipping_on_device(optimizer, found)
            return taken
        with record_function("mixprec.found_inf_sync"):      # the one host sync: step or skip
            take = scaler.decide(optimizer)
        scaler.update()                                    # back off at once, grow when clean
        if take:                                           # 3. optim/: the step
            inputs = StepInputs(inv_scale=inv_scale, clip_coef=clip_coef) if masters else None
            with record_function("mixprec.optimizer_step"):
                if overlap is not None:
                    overlap.issue(optimizer, inputs)       # per module, side stream (optim/overlap.py)
                elif masters:
                    optimizer.step(inputs=inputs)          # FP32 masters copied back inside
                else:
                    optimizer.step()
        return take                                        # decided on the host: a bool

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.spec(), "name": self.name, "scaler": self.scaler.state_dict(),
                "overrides": [list(o) for o in self.policy.overrides]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("policy") != self.policy.spec() or \
                normalize_overrides(state.get("overrides", ())) != self.policy.overrides:
            raise CheckpointError(f"the state was saved under precision {state.get('name') or state.get('policy')}, "
                                  f"this run uses {self.name}; use the same precision to resume")
        self.scaler.load_state_dict(state["scaler"])



class _StepGrads:
    """The gradients of one step, asked of the optimizer by :meth:`Precision.step` (the grad
    protocol of docs/CONTRACTS.md, amp/grads.py) and handed to the scaler and the clip as tensors:
    ``grads`` (its FP32 master grads; None: the ``.grad`` of its param groups, which the scaler
    reads itself) and, for split masters, ``low`` (their deferred model-dtype grads), ``order``
    (all in param-group order) and ``batches`` (the step's FP32 scratch views, for the norm)."""

    __slots__ = ("grads", "low", "order", "batches")

    def __init__(self, grads: list[torch.Tensor] | None, low: list[torch.Tensor] | None = None,
                 order: list[torch.Tensor] | None = None, batches: Any = None) -> None:
        self.grads, self.low, self.order, self.batches = grads, low, order, batches

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> _StepGrads:
        deferred = optimizer.deferred_grads() if isinstance(optimizer, HasDeferredGrads) else None
        if deferred is not None:
            return cls(deferred.own, deferred.low, [g for _, g in deferred.entries], deferred.batches)
        if isinstance(optimizer, HasMasterGrads):
            return cls(optimizer.master_grads())
        return cls(None)


def _recipe_of(precision: Any, *, device: torch.device, overrides: Any, micro_options: Any,
               optimizer: torch.optim.Optimizer | None, split_masters: bool, moments: str,
               fp8_activations: bool, **scaler_options: Any) -> Recipe:
    """The recipe a :class:`Precision` is built from: ``precision`` itself when it is one (any
    other choice given with it is refused in one line), else :meth:`Recipe.build`'s."""
    if not isinstance(precision, Recipe):
        return Recipe.build(precision, device=device, overrides=overrides, micro_options=micro_options,
                            optimizer=optimizer, split_masters=split_masters, moments=moments,
                            fp8_activations=fp8_activations, **scaler_options)
    given = [n for n, v in (("overrides", overrides), ("micro_options", micro_options),
                            ("optimizer", optimizer), ("split_masters", not split_masters),
                            ("moments", moments != "fp32"),
                            ("fp8_activations", fp8_activations)) if v] + sorted(scaler_options)
    if given:
        raise ConfigError(f"Precision(recipe) takes every choice from the recipe; build the "
                          f"recipe with {given[0]}=: Recipe.build(mode, {given[0]}=...)")
    return precision


def identity(policy: Policy) -> str:
    """The mode and overrides a model set up under ``policy`` is tagged with
    (``identity(precision.policy)``)."""
    ov = ",".join(f"{p}={f}" for p, f in policy.overrides)
    return policy.spec() + (f" overrides[{ov}]" if ov else "")


def setup_identity(model: nn.Module) -> str | None:
    """What ``model`` was set up for (:func:`identity`), None if it never was."""
    return getattr(model, _SETUP_TAG, None)


def forget_setup(model: nn.Module) -> None:
    """Let another Precision set ``model`` up. Only for a model whose set-up left its modules
    and dtypes as they were (``32-true`` without overrides), e.g. the planner's copies of a
    model ``fit()`` trained in FP32."""
    if hasattr(model, _SETUP_TAG):
        delattr(model, _SETUP_TAG)


def prepare_fp8(model: nn.Module, policy: Policy | str) -> Any:
    """Swap ``model``'s Linears to the formats ``mixprec.Precision(policy)`` gives them, without
    casting parameters or touching an optimizer; the FP8 report, or None when no layer asks for FP8.

    A thin call of the decider (:meth:`mixprec.precision.Layers.apply`); ``fit()`` and
    ``Precision.setup`` do this themselves, so call it only to study FP8 numerics by hand."""
    precision = Precision(policy)
    precision.layers.apply(model)
    return precision.layers.fp8_report
