"""`Precision`: one object per precision mode that makes every precision decision of a run.

A :class:`~mixprec.precision.Policy` is data (which dtype where). ``Precision`` is where those
data become decisions, each made here and nowhere else:

==========================  =====================================================================
decision                    made by
==========================  =====================================================================
every choice of the run     the frozen :class:`~mixprec.precision.recipe.Recipe` it is built
                            from (:attr:`Precision.recipe`), fixed at construction
what each layer is         the rule book, :mod:`mixprec.precision.rules`
every layer, in one table   :meth:`Precision.resolve` / :meth:`Precision.describe` (model)
every per-layer question    :attr:`Precision.layers` (:class:`~mixprec.precision.layers.Layers`):
                            storage dtype (``param_dtype_for``; norms, gates, ``keep_in_fp32``,
                            ``keep_fp32_names`` stay FP32: ``keep_fp32_reason``), each Linear's
                            format (``format_for``; per-module overrides, first match wins), the
                            live formats (``formats``) and the table of the model set up
FP32 master weights         :attr:`Precision.keeps_masters`; which params: the table's ``master``
                            column, ``layers.master_params``, handed to ``MasterWeights``
FP8 GEMMs                   :attr:`Precision.fp8_config`; :meth:`setup` swaps eligible Linears
micro-format GEMMs          :meth:`Precision.micro_config` (MXFP8 / MXFP4 / NVFP4 recipes and
                            their options); :meth:`setup` swaps eligible Linears
loss scaling                :attr:`Precision.scales_loss`; :meth:`backward` / :meth:`step`
the forward's dtype         :meth:`autocast`, :meth:`convert_output`
gradient reduction          :attr:`reduce_dtype`, :meth:`fsdp_mixed_precision`,
                            :meth:`fsdp_island_policy`, :meth:`casts_before_sharding`
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
import inspect
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd.profiler import record_function

from mixprec import _moved
from mixprec.amp import GradScaler, clip_grad_norm_
from mixprec.errors import CheckpointError, ConfigError
from mixprec.optim import AdamW, MasterWeights
from mixprec.optim.inputs import StepInputs, skips_on_device, step_skipping_on_device
from mixprec.policy import hardware
from mixprec.policy.overrides import check_patterns, normalize_overrides
from mixprec.policy.policy import Policy, get_policy
from mixprec.precision.autocast import autocast
from mixprec.precision.cast import cast_module
from mixprec.precision.layers import Layers
from mixprec.precision.recipe import Recipe
from mixprec.precision.table import LayerTable

if TYPE_CHECKING:
    from mixprec.optim.overlap import OverlappedUpdate

__all__ = ["Precision", "OptimizerSpec", "StepTaken", "prepare_fp8"]

_F32 = torch.float32
_LOW = (torch.bfloat16, torch.float16)

OptimizerSpec = torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None
"""An optimizer over the model's parameters, a factory ``params -> optimizer``, or None."""

_SETUP_TAG = "_mixprec_precision"


_FSDP2_NO_SPLIT = ("split masters: nothing to split under FSDP2, whose FP32 parameter shards are the "
                   "masters (4 bytes per parameter / world, what split masters' BF16 parameter + 16-bit "
                   "remainder also cost) and whose BF16 copies exist only while a layer is gathered")
"""Why ``split_masters`` has no effect under FSDP2 (docs/lean.md), recorded in ``Precision.notes``."""


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


class Precision:
    """The precision mode of a run, and every decision it implies.

    Args:
        precision: a preset name (``"bf16-mixed"``), an alias, the compact form
            (``"p=f32,c=bf16,o=f32"``), ``True``/``"auto"`` (best safe mode for ``device``), or a
            :class:`~mixprec.precision.Policy`, or a ready :class:`~mixprec.precision.recipe.Recipe`
            (which holds every other choice below: pass none of them with it).
        device: where the model runs (default: the model's device at :meth:`setup`, else CUDA when
            available, else CPU); decides ``auto`` and the autocast device type.
        overrides: per-module compute formats ``{pattern: format}`` or ``((pattern, format), ...)``
            (``fp32``, ``bf16``, ``fp16``, ``fp8-<recipe>``, ``mxfp8``, ``mxfp4``, ``nvfp4``; first
            match wins); they come before (so win over) overrides the policy already carries, e.g.
            from a plan file.
        micro_options: changes to the micro-format recipes (``"hadamard_wgrad=false"``, a dict,
            or pairs; fields of :class:`mixprec.formats.MicroConfig`), checked here.
        optimizer: an optimizer that already stores the parameters in 16 bits
            (``fp16_params=True``): ``auto`` becomes the matching ``*-true`` mode (and says so in
            :attr:`notes`), another mode with FP32 parameters is refused in one line.
        split_masters, moments, fp8_activations: the optimizer's master layout and moments
            storage (:meth:`make_optimizer`), activations saved in FP8 (``fit()``); see
            :class:`~mixprec.precision.recipe.Recipe`.
        **scaler_options: passed to :class:`mixprec.amp.GradScaler` (``init_scale``,
            ``growth_interval``, ``hysteresis``, ``min_scale``, ``on_min_scale``, ...). Scaling is
            on only when the mode needs it (FP16); the non-finite check and skip are always on.
    """

    def __init__(self, precision: str | Policy | Recipe | bool | None = "auto", *,
                 device: torch.device | str | None = None, overrides: Any = None,
                 micro_options: Any = None, optimizer: torch.optim.Optimizer | None = None,
                 split_masters: bool = True, moments: str = "fp32", fp8_activations: bool = False,
                 **scaler_options: Any) -> None:
        self.device = torch.device(device) if device is not None else hardware.default_device()
        if isinstance(precision, Recipe):
            given = [n for n, v in (("overrides", overrides), ("micro_options", micro_options),
                                    ("optimizer", optimizer), ("split_masters", not split_masters),
                                    ("moments", moments != "fp32"),
                                    ("fp8_activations", fp8_activations)) if v] + sorted(scaler_options)
            if given:
                raise ConfigError(f"Precision(recipe) takes every choice from the recipe; build the "
                                  f"recipe with {given[0]}=: Recipe.build(mode, {given[0]}=...)")
            recipe = precision
        else:
            recipe = Recipe.build(precision, device=self.device, overrides=overrides,
                                  micro_options=micro_options, optimizer=optimizer,
                                  split_masters=split_masters, moments=moments,
                                  fp8_activations=fp8_activations, **scaler_options)
        self._recipe = recipe
        self._scaler: GradScaler | None = None   # built on first use: cheap questions need none
        self.notes: list[str] = list(recipe.notes)
        """What building the recipe and :meth:`setup` chose on the user's behalf, for the run log."""
        self.layers = Layers(recipe)
        """Every per-layer question, and the live formats of the model :meth:`setup` set up
        (:class:`~mixprec.precision.layers.Layers`)."""
        self.last_grad_norm: torch.Tensor | None = None
        """The unscaled global gradient norm of the last :meth:`step` (when clipped or measured)."""

    @property
    def scaler(self) -> GradScaler:
        """The loss scaler of the step (disabled unless the mode scales), built on first use."""
        if self._scaler is None:
            self._scaler = GradScaler(enabled=self.scales_loss, **self.recipe.scaler_options)
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
        return self.policy.name if self.policy.name != "custom" else self.policy.spec()

    @property
    def param_dtype(self) -> torch.dtype:
        return self.policy.param_dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.policy.compute_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced in across ranks."""
        return self.policy.reduce_dtype

    @property
    def stores_low_precision(self) -> bool:
        """Parameters (other than the FP32 exemptions) are stored in 16 bits."""
        return self.policy.param_dtype in _LOW

    @property
    def keeps_masters(self) -> bool:
        """16-bit parameters are updated through FP32 master copies in the optimizer."""
        return self.stores_low_precision and bool(self.policy.master_weights)

    @property
    def loses_small_updates(self) -> bool:
        """16-bit parameters without masters: updates below half an ULP are rounded away."""
        return self.stores_low_precision and not self.policy.master_weights

    @property
    def scales_loss(self) -> bool:
        """Dynamic loss scaling is on (FP16 compute or storage)."""
        return bool(self.policy.loss_scaling)

    @property
    def autocasts(self) -> bool:
        """The forward runs under autocast (the compute dtype is below FP32)."""
        return self.policy.is_mixed

    @property
    def autocast_copies_weights(self) -> bool:
        """Autocast makes compute-dtype copies of weights stored in a wider dtype."""
        return self.autocasts and self.param_dtype.itemsize > self.compute_dtype.itemsize

    @property
    def fp8_config(self):
        """The :class:`mixprec.formats.Fp8Config` of ``fp8-*`` modes, else None."""
        return self.recipe.fp8

    @property
    def micro_formats(self) -> list[str]:
        """The micro formats some layer may run in (the mode's and the overrides')."""
        return [f for f, _ in self.recipe.micro]

    def micro_config(self, fmt: str):
        """The :class:`mixprec.formats.MicroConfig` of micro format ``fmt`` with the mode's
        ``micro_options``."""
        return self.recipe.micro_config(fmt)

    def casts_before_sharding(self) -> bool:
        """Under FSDP2 the FP32 shards are the masters; only a mode without masters casts the
        model to its 16-bit storage dtype before sharding."""
        return self.loses_small_updates

    def fsdp_mixed_precision(self):
        """FSDP2's ``MixedPrecisionPolicy`` for the ordinary units (see strategies/fsdp.py)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy
        gather = self.compute_dtype if self.autocasts else self.param_dtype
        if gather == _F32:
            return MixedPrecisionPolicy(reduce_dtype=None if self.reduce_dtype == _F32 else self.reduce_dtype)
        return MixedPrecisionPolicy(param_dtype=gather, reduce_dtype=self.reduce_dtype)

    def fsdp_island_policy(self):
        """FSDP2's policy for units kept in FP32 (norms, gates), or None when every unit gathers
        FP32 anyway: parameters FP32, output cast back to the gather dtype."""
        from torch.distributed.fsdp import MixedPrecisionPolicy
        gather = self.fsdp_mixed_precision().param_dtype
        if gather is None:
            return None
        return MixedPrecisionPolicy(param_dtype=_F32, reduce_dtype=_F32, output_dtype=gather)

    def resolve(self, model: nn.Module) -> LayerTable:
        """Every decision for ``model``, one row per parameter-owning module (:meth:`Layers.resolve`)."""
        return self.layers.resolve(model)

    def describe(self, model: nn.Module | None = None) -> str:
        """With ``model``: its per-layer table, to print; without: one line for logs (:meth:`Layers.describe`)."""
        return self.layers.describe(model)

    def __getattr__(self, name: str) -> Any:
        _moved.refuse_member("Precision", name)   # members retired in 0.4: one line naming the new home

    def __repr__(self) -> str:
        return f"Precision({self.name!r})"

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
        self.check_optimizer(built)
        model = self.setup_module(model, optimizer=built)
        return model, self.setup_optimizer(optimizer, model)

    def check_optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Refuse, in one line, an optimizer that stores the model's parameters in a 16-bit dtype
        this mode does not (``mixprec.optim.AdamW(..., fp16_params=True)``). The mode is fixed
        when the Precision is built: for ``auto`` to follow such an optimizer, build it with the
        optimizer, ``Precision("auto", optimizer=optimizer)`` (``fit()`` does)."""
        self.recipe.check_optimizer(optimizer)

    def setup_module(self, model: nn.Module, *, sharded: bool = False,
                     optimizer: torch.optim.Optimizer | None = None) -> nn.Module:
        """Storage dtypes and the FP8 swap, in place. ``sharded``: FSDP2 will shard the model, and
        its FP32 shards are the masters (cast only modes without masters). ``optimizer``: one that
        already converted parameters (``fp16_params=True``); FP32-exempt ones get their exact FP32
        master values back."""
        done = getattr(model, _SETUP_TAG, None)
        if done is not None:
            if done != self._identity():
                raise ConfigError(f"this model was already set up for precision {done}; build a "
                                  f"new model to train it in {self._identity()}")
            return model
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        if self.policy.plan is not None:        # a plan file made for another model: refused
            self.policy.plan.check(linears)
        check_patterns(self.policy.overrides, linears)
        first = next(model.parameters(), None)
        if first is not None:
            self.device = first.device
        if not sharded or self.casts_before_sharding():
            # Storage dtypes (FP32 exemptions kept; an fp16_params optimizer's exact FP32 masters
            # go back into exempt parameters).
            master_of = getattr(optimizer, "master_of", None)
            cast_module(model, self.policy, dtype_for=self.layers.param_dtype_for,
                        master_of=(lambda p: _master_or_none(master_of, p)) if master_of else None)
        self.layers.apply(model)
        setattr(model, _SETUP_TAG, self._identity())
        self.layers.table = self.layers.resolve(model)
        return model

    @property
    def identity(self) -> str:
        """The mode and overrides a model set up by this object is tagged with."""
        return self._identity()

    @staticmethod
    def setup_identity(model: nn.Module) -> str | None:
        """What ``model`` was set up for (:attr:`identity`), None if it never was."""
        return getattr(model, _SETUP_TAG, None)

    @staticmethod
    def forget_setup(model: nn.Module) -> None:
        """Let another Precision set ``model`` up. Only for a model whose set-up left its modules
        and dtypes as they were (``32-true`` without overrides), e.g. the planner's copies of a
        model ``fit()`` trained in FP32."""
        if hasattr(model, _SETUP_TAG):
            delattr(model, _SETUP_TAG)

    def _identity(self) -> str:
        ov = ",".join(f"{p}={f}" for p, f in self.policy.overrides)
        return self.policy.spec() + (f" overrides[{ov}]" if ov else "")

    def setup_optimizer(self, optimizer: OptimizerSpec, model: nn.Module, *,
                        sharded: bool = False) -> torch.optim.Optimizer | None:
        """The optimizer this mode needs: ``optimizer`` itself, or wrapped in FP32 masters."""
        if optimizer is None:
            return None
        if not isinstance(optimizer, torch.optim.Optimizer):
            if not callable(optimizer):
                raise ConfigError(f"optimizer must be a torch optimizer or a factory params -> "
                                  f"optimizer, not {type(optimizer).__name__}")
            optimizer = optimizer([p for p in model.parameters() if p.requires_grad])
        if isinstance(optimizer, MasterWeights) or sharded or not self.keeps_masters:
            return optimizer
        if optimizer.state:
            raise ConfigError(f"the {type(optimizer).__name__} has already stepped; call "
                              "precision.setup(model, optimizer) before training")
        accepted = inspect.signature(type(optimizer).__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])}
                  for g in optimizer.param_groups]
        self.notes.append(f"{type(optimizer).__name__} steps FP32 master weights "
                          "(mixprec.optim.MasterWeights)")
        # The recipe's layout: split_masters=False keeps full FP32 masters for your optimizer too
        # (it was ignored here: found writing docs/ARCHITECTURE.md's walk); True splits where exact.
        split = None if self.recipe.split_masters else False
        return MasterWeights(type(optimizer), groups, master_params=self.layers.master_params(model),
                             split=split, **defaults)

    def make_optimizer(self, param_groups: list[dict[str, Any]], *, sharded: bool = False,
                       split_masters: bool | None = None, moments: str | None = None,
                       model: nn.Module | None = None,
                       **adamw_options: Any) -> torch.optim.Optimizer:
        """The default AdamW for this mode: mixprec's (FP32 masters of 16-bit parameters, split
        into the BF16 parameter + a 16-bit remainder unless ``split_masters=False``; moments in
        ``moments``) unless FSDP2's FP32 shards are the masters already or the mode asks for no
        masters (torch's AdamW, FP32 moments only). ``model``: masters exactly for the table's set
        (:meth:`master_params`); without it, by dtype (see ``MasterWeights``).

        Where no parameter has a separate master (``32-true``, ``bf16-mixed``, ``16-mixed``) and
        the parameters are on CUDA, the inner torch AdamW is ``fused=True`` (unless ``fused`` or
        ``foreach`` is given): torch's fast path, and it skips a non-finite step on the device
        (:meth:`step`). Not on a CPU: there torch's fused kernel rounds differently from the
        foreach one (1 ulp), and a step on the CPU stays the bits it was (a hand loop with torch's
        default AdamW equals ``fit()``). The state dicts of the two are alike: a checkpoint
        resumes across them (docs/performance.md). ``split_masters`` and ``moments`` default to
        the recipe's."""
        from mixprec.optim.moments import MOMENTS
        split_masters = self.recipe.split_masters if split_masters is None else split_masters
        moments = self.recipe.moments if moments is None else moments
        if moments not in MOMENTS:
            raise ConfigError(f"moments must be one of {', '.join(MOMENTS)}, got '{moments}'")
        if sharded or self.loses_small_updates:
            if sharded and split_masters and self.keeps_masters:
                self.notes.append(_FSDP2_NO_SPLIT)
            if moments == "fp32":
                return torch.optim.AdamW(param_groups, **adamw_options)
            if self.loses_small_updates:
                raise ConfigError(f"moments={moments} needs mixprec's AdamW, but precision '{self.name}' keeps "
                                  "no masters and uses torch's AdamW; use moments=fp32")
            # FSDP2: its FP32 shards are the masters; the moments shard (and reshard) with them.
            from mixprec.optim.adamw import sharded_adamw
            self.notes.append(f"FSDP2: mixprec's FP32-math AdamW steps the FP32 shards with moments={moments}"
                              + (" (matrices; vectors keep FP32 moments), sharded and resharded with the "
                                 "parameters" if moments != "bf16" else ""))
            return sharded_adamw(param_groups, moments=moments, **adamw_options)
        masters = self.layers.master_params(model) if model is not None else None
        if _fuses(param_groups, masters, moments, self.keeps_masters, adamw_options):
            adamw_options = {**adamw_options, "fused": True}
            self.notes.append("AdamW: torch's fused kernel (fused=True, CUDA), which skips a non-finite "
                              "step on the device: no host read per step")
        opt = AdamW(param_groups, split_masters=split_masters, moments=moments, master_params=masters,
                    **adamw_options)
        if opt.split_count:       # said only where a BF16 parameter got one (not under 32-true)
            self.notes.append("FP32 masters of BF16 parameters split: the parameter + a 16-bit "
                              "remainder, no FP32 master gradients (bit-identical)")
        if moments != "fp32":
            self.notes.append(f"Adam moments stored in {moments}"
                              + ("" if moments == "bf16" else " with per-block scales (matrices; "
                                 "vectors keep FP32 moments)") + ", widened to FP32 in the update "
                              "(moments; docs/lean.md)")
        return opt

    # ------------------------------------------------------------------ the step

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's context: matmuls in the compute dtype (FP32 means autocast off)."""
        return autocast(self.policy, device_type=self.device.type)

    def convert_output(self, x: Any) -> Any:
        """Cast a floating output tensor to the mode's output dtype (others pass through)."""
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(self.policy.output_dtype)
        return x

    def scale_loss(self, loss: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
        """``loss`` multiplied by the loss scale when the mode scales (FP16), else ``loss``: for a
        framework that calls ``backward`` itself (the Lightning plugin). ``scale``: an earlier
        step's scale instead (the non-finite replay)."""
        with record_function("mixprec.scale_loss"):
            return self.scaler.scale(loss, value=scale)

    def backward(self, loss: torch.Tensor, *, scale: float | None = None) -> None:
        """``loss.backward()``, multiplied by the loss scale when the mode scales (FP16).
        ``scale``: replay an earlier step at the scale it used (the non-finite trace)."""
        self.scale_loss(loss, scale=scale).backward()

    def step(self, optimizer: torch.optim.Optimizer, *, clip_grad_norm: float | None = None,
             measure_grad_norm: bool = False, overlap: OverlappedUpdate | None = None) -> bool | StepTaken:
        """Finish an optimizer step; return whether it was taken: a ``bool`` where the host
        decided, a :class:`StepTaken` where the step was skipped (or not) on the device: truthy if
        taken, falsy if skipped, equal to ``True``/``False``, its truth read from the device only
        when asked, once (``is True`` does not hold for it: test its truth).

        Unscales once (fused with the inf/NaN check, agreed across ranks under
        ``torch.distributed``), clips the unscaled gradients to ``clip_grad_norm`` (or only
        measures their norm with ``measure_grad_norm``; either way :attr:`last_grad_norm`), then
        steps (FP32 masters copied back into the 16-bit parameters) or skips the whole step, and
        updates the loss scale.

        The skip: a mixprec master-weight optimizer gets the non-finite flag as a device tensor
        (:class:`~mixprec.optim.inputs.StepInputs`) and skips on the device, and so does torch's
        ``fused=True`` Adam/AdamW/SGD/Adagrad (the flag as its ``found_inf`` attribute, as
        torch's ``GradScaler.step`` hands it; from its second step on: a skipped first step must
        create no state); the loss scale moves on the device too, and the host reads nothing:
        the counters, the scale and the return value's truth are read when asked for
        (``bool(taken)``, :attr:`num_skipped_steps`, :attr:`scale`, ...; one read for everything
        queued). Any other optimizer (or ``overlap``): the host reads the flag first and steps or
        not.

        ``overlap``: an :class:`~mixprec.optim.overlap.OverlappedUpdate`; a taken step is then
        issued per module on a side CUDA stream (in order on CPU), bit-identical to the plain step.
        """
        with record_function("mixprec.unscale"):           # fused with the inf/NaN check
            self.scaler.unscale_(optimizer)
        self.last_grad_norm = None
        if clip_grad_norm or measure_grad_norm:            # clip sees unscaled gradients
            with record_function("mixprec.clip_grad_norm"):
                self.last_grad_norm = clip_grad_norm_(self.scaler, optimizer,
                                                      clip_grad_norm or math.inf)
        masters = isinstance(optimizer, MasterWeights)
        found = (self.scaler.found_inf(optimizer)
                 if overlap is None and (masters or skips_on_device(optimizer)) else None)
        if found is not None:
            with record_function("mixprec.optimizer_step"):  # skipped on the device when found > 0
                if masters:
                    optimizer.step(inputs=StepInputs(found_inf=found))
                else:                                      # torch's fused=True: as torch hands it
                    step_skipping_on_device(optimizer, found)
            self.scaler.stepped_on_device(optimizer)       # no host read: the flag stays queued
            self.scaler.update()                           # the scale moves on the device
            taken = StepTaken(found, resolve=self.scaler.resolve)   # read only if the caller asks
            self.scaler.tell_when_read(found, taken)
            return taken
        else:
            with record_function("mixprec.found_inf_sync"):  # the one host sync: step or skip
                take = self.scaler.decide(optimizer)
            if take:
                with record_function("mixprec.optimizer_step"):
                    if overlap is None:
                        optimizer.step()                   # FP32 masters copied back inside
                    else:
                        overlap.issue(optimizer)           # per module, side stream (optim/overlap.py)
        self.scaler.update()                               # back off at once, grow when clean
        return take                                        # decided on the host: a bool

    @property
    def last_step_skipped(self) -> bool:
        return self.scaler.last_step_skipped

    @property
    def num_skipped_steps(self) -> int:
        return self.scaler.num_skipped_steps

    @property
    def scale(self) -> float:
        """The current loss scale (1.0 when the mode does not scale)."""
        return self.scaler.get_scale()

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



def _fuses(param_groups: list[dict[str, Any]], masters: list[torch.Tensor] | None, moments: str,
           keeps_masters: bool, options: dict[str, Any]) -> bool:
    """Whether :meth:`Precision.make_optimizer` makes its torch AdamW ``fused=True``: FP32
    moments, no separate master (by the table's set, or by the mode without one), every
    parameter on CUDA, and neither ``fused`` nor ``foreach`` chosen by the caller."""
    if moments != "fp32" or keeps_masters or masters or "fused" in options or "foreach" in options:
        return False
    params = [p for g in param_groups for p in g["params"]]
    return bool(params) and all(p.device.type == "cuda" and p.dtype == torch.float32 for p in params)


def _master_or_none(master_of: Callable[[torch.Tensor], torch.Tensor] | None,
                    p: torch.Tensor) -> torch.Tensor | None:
    if master_of is None:
        return None
    try:
        return master_of(p)
    except ConfigError:   # not one of the optimizer's parameters
        return None


def prepare_fp8(model: nn.Module, policy: Policy | str) -> Any:
    """Swap ``model``'s Linears to the formats ``mixprec.Precision(policy)`` gives them, without
    casting parameters or touching an optimizer; the FP8 report, or None when no layer asks for FP8.

    A thin call of the decider (:meth:`mixprec.precision.layers.Layers.apply`); ``fit()`` and
    ``Precision.setup`` do this themselves, so call it only to study FP8 numerics by hand."""
    layers = Precision(policy).layers
    layers.apply(model)
    return layers.fp8_report
