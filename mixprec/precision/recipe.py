"""`Recipe`: every precision choice of a run in one frozen, printable, serialisable object.

A :class:`~mixprec.policy.Policy` names the dtypes, the FP8 or micro format and the per-layer
overrides; a run chooses more than that: the layout of the FP32 masters (none, full, split), the
storage of Adam's moments, whether what Linear layers save for backward is kept in FP8, the loss
scaler's settings. A ``Recipe`` holds all of it, validated once, when it is built, with the same
one-line errors the settings always had; nothing changes it afterwards (a
:class:`mixprec.Precision` is built from one and never changes its mode).

Build one with :meth:`Recipe.build` (a policy name, ``auto``, the compact form, ``plan:PATH``, a
``Policy``; the optimizer, when it already stores the parameters in 16 bits, is asked here, once),
from ``fit()``'s settings (``FitConfig.recipe()``), or from a dict or TOML table written by
:meth:`to_dict` / :meth:`to_toml` (the ``[recipe]`` table of a run's ``config.toml``)::

    recipe = Recipe.build("bf16-true", moments="int8")
    print(recipe)                                   # one readable block
    assert Recipe.from_toml(recipe.to_toml()) == recipe
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from mixprec.amp.loss_scale import DynamicLossScaler
from mixprec.errors import ConfigError, closest
from mixprec.formats.fp8_config import Fp8Config
from mixprec.formats.micro_config import MicroConfig, parse_micro_options
from mixprec.optim.moments import MOMENTS
from mixprec.policy.dtypes import FP8_E4M3, FP8_E5M2, dtype_name
from mixprec.policy.overrides import is_micro, normalize_overrides
from mixprec.policy.policy import Policy, get_policy
from mixprec.precision import recipe_io as _io
from mixprec.precision.recipe_io import SCALER_ARGS as _SCALER_ARGS

__all__ = ["Recipe", "MASTER_LAYOUTS", "is_auto"]

_LOW = (torch.bfloat16, torch.float16)
_TRUE_MODE = {torch.bfloat16: "bf16-true", torch.float16: "16-true"}

MASTER_LAYOUTS = ("none", "full", "split")
"""Where the FP32 masters of 16-bit parameters live: none (FP32 parameters, or 16-bit ones updated
in place), full (an FP32 copy per parameter), split (the BF16 parameter + a 16-bit remainder)."""

def is_auto(precision: Any) -> bool:
    """``True``, ``"auto"``, ``"true"`` or ``"best"``: the best safe mode for the device."""
    return precision is True or (isinstance(precision, str)
                                 and precision.strip().lower() in ("auto", "true", "best"))


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """Every precision choice of a run. Build one with :meth:`build`; frozen."""

    policy: Policy
    """The dtypes, the FP8 recipe or micro format (and its options), the FP32 exemptions, the
    per-layer overrides and the plan file they came from (:class:`~mixprec.policy.Policy`)."""
    split_masters: bool = True
    """The FP32 master of a BF16 parameter is the parameter + a 16-bit remainder (mixprec's
    AdamW); False: a full FP32 copy. See :attr:`masters`."""
    moments: str = "fp32"
    """Storage of Adam's two moments (``mixprec.optim.moments.MOMENTS``)."""
    fp8_activations: bool = False
    """What Linear layers save for backward is kept in FP8 E4M3 (``mixprec.nn.fp8_activations``)."""
    scaler: tuple[tuple[str, Any], ...] = ()
    """Loss-scaler settings other than the defaults (``GradScaler``'s arguments: ``init_scale``,
    ``growth_interval``, ``hysteresis``, ``min_scale``, ``on_min_scale``, ...). Scaling itself is
    on only where the policy scales (``policy.loss_scaling``). Also accepts a dict."""
    resolved_from: str = ""
    """The mode asked for when building resolved it to another (``bf16-mixed`` for ``auto`` with an
    optimizer that stores FP16 parameters, which runs ``16-true``); ``""`` otherwise."""
    fp8: Fp8Config | None = field(init=False, compare=False)
    """The FP8 recipe of ``fp8-*`` modes (built from ``policy.fp8_recipe``), else None."""
    micro: tuple[tuple[str, MicroConfig], ...] = field(init=False, compare=False)
    """The micro-format recipes some layer may run in (the mode's and the overrides'), with the
    policy's ``micro_options`` applied."""

    def __post_init__(self) -> None:
        if not isinstance(self.policy, Policy):
            raise ConfigError(f"Recipe.policy must be a Policy, not {type(self.policy).__name__}; "
                              "build one with Recipe.build(name)")
        if self.moments not in MOMENTS:
            raise ConfigError(f"moments must be one of {', '.join(MOMENTS)}, got '{self.moments}'")
        if self.moments != "fp32" and self.policy.low_precision_params and not self.policy.master_weights:
            raise ConfigError(f"moments={self.moments} needs mixprec's AdamW, but precision "
                              f"'{self.name}' keeps no masters and uses torch's AdamW; use moments=fp32")
        object.__setattr__(self, "scaler", _scaler_pairs(self.scaler))
        p = self.policy
        object.__setattr__(self, "fp8", Fp8Config.from_recipe(p.fp8_recipe) if p.fp8_recipe else None)
        asked = [p.micro_format, *(f for _, f in p.overrides)]
        formats = list(dict.fromkeys(f for f in asked if f and is_micro(f)))
        # An option that does not fit a recipe is refused here, not when a layer is converted.
        object.__setattr__(self, "micro", tuple(
            (f, MicroConfig.from_recipe(f, **dict(p.micro_options))) for f in formats))

    # ------------------------------------------------------------------ building

    @classmethod
    def build(cls, precision: str | Policy | bool | None = "auto", *,
              device: torch.device | str | None = None, overrides: Any = None,
              micro_options: Any = None, optimizer: torch.optim.Optimizer | None = None,
              split_masters: bool = True, moments: str = "fp32", fp8_activations: bool = False,
              **scaler_options: Any) -> "Recipe":
        """The recipe of ``precision`` (a preset name, an alias, the compact form, ``plan:PATH``,
        ``True``/``"auto"`` for the best safe mode on ``device``, or a ``Policy``).

        ``overrides`` come before (so win over) the policy's own, e.g. a plan file's.
        ``optimizer``: one that already stores the parameters in 16 bits
        (``mixprec.optim.AdamW(..., fp16_params=True)``) decides ``auto`` (the matching ``*-true``
        mode) and is refused, in one line, with any other mode that keeps FP32 parameters."""
        return _build(cls, precision, device=device, overrides=overrides, micro_options=micro_options,
                      optimizer=optimizer, split_masters=split_masters, moments=moments,
                      fp8_activations=fp8_activations, **scaler_options)

    # ------------------------------------------------------------------ what it says

    @property
    def name(self) -> str:
        """The mode's name (the compact form for a custom policy)."""
        return self.policy.name if self.policy.name != "custom" else self.policy.spec()

    @property
    def keeps_masters(self) -> bool:
        """16-bit parameters are updated through FP32 masters."""
        return self.policy.low_precision_params and bool(self.policy.master_weights)

    @property
    def masters(self) -> str:
        """The master layout mixprec's optimizer builds (``MASTER_LAYOUTS``): ``split`` for BF16
        parameters with ``split_masters``, ``full`` for other 16-bit ones, ``none`` without masters.
        (The params plugin builds this layout's class around mixprec's AdamW or a torch optimizer of
        your own; under FSDP2 the FP32 shards are the masters.)"""
        if not self.keeps_masters:
            return "none"
        return "split" if self.split_masters and self.policy.param_dtype == torch.bfloat16 else "full"

    @property
    def scales_loss(self) -> bool:
        return bool(self.policy.loss_scaling)

    # ------------------------------------------------------------------ dtypes and what they imply

    @property
    def param_dtype(self) -> torch.dtype:
        """The storage dtype of parameters (other than the FP32 exemptions)."""
        return self.policy.param_dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matmuls compute in (per-layer formats aside)."""
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
    def loses_small_updates(self) -> bool:
        """16-bit parameters without masters: updates below half an ULP are rounded away."""
        return self.stores_low_precision and not self.policy.master_weights

    @property
    def autocasts(self) -> bool:
        """The forward runs under autocast (the compute dtype is below the parameters')."""
        return self.policy.is_mixed

    @property
    def autocast_copies_weights(self) -> bool:
        """Autocast makes compute-dtype copies of weights stored in a wider dtype."""
        return self.autocasts and self.param_dtype.itemsize > self.compute_dtype.itemsize

    # --- the formats (asked per layer by mixprec.precision.layers.Layers) -----------------------

    @property
    def fp8_recipe(self) -> str | None:
        """The FP8 recipe name of ``fp8-*`` modes, else None."""
        return self.policy.fp8_recipe

    @property
    def has_plan(self) -> bool:
        """Some layers carry a per-layer format (overrides, a plan file) on top of the mode."""
        return bool(self.policy.overrides)

    @property
    def label(self) -> str:
        """What runs, short (run folder, last line, reports): :attr:`name`, ``+plan`` with one."""
        return f"{self.name}+plan" if self.has_plan else self.name

    @property
    def base_format(self) -> str:
        """A layer's format when nothing makes it FP8 or overrides it: the compute dtype's name."""
        return dtype_name(self.policy.compute_dtype)

    @property
    def default_format(self) -> str:
        """What a Linear without an override asks for: ``fp8-<recipe>``, the micro format, else
        :attr:`base_format`."""
        if self.policy.micro_format:
            return self.policy.micro_format
        return f"fp8-{self.policy.fp8_recipe}" if self.policy.fp8_recipe else self.base_format

    @property
    def uses_fp8(self) -> bool:
        """Some layer may run in FP8 (an ``fp8-*`` mode, or an FP8 override)."""
        return bool(self.policy.fp8_recipe) or any(f.startswith("fp8-") for _, f in self.policy.overrides)

    @property
    def matmul_format(self) -> str:
        """The format the mode's GEMMs run in: ``fp4`` (MXFP4, NVFP4), ``fp8`` (FP8, MXFP8),
        ``bf16``, ``fp16``, ``tf32`` or ``fp32``."""
        p = self.policy
        if p.micro_format:
            return "fp8" if p.micro_format == "mxfp8" else "fp4"
        if p.fp8_recipe:
            return "fp8"
        if p.is_mixed or p.low_precision_params:
            return self.base_format
        return "tf32" if p.allow_tf32 else "fp32"

    @property
    def activation_format(self) -> torch.dtype:
        """The format whose range activations must fit (FP8 E4M3 for ``fp8-*``)."""
        return FP8_E4M3 if self.policy.fp8_recipe else self.policy.compute_dtype

    @property
    def gradient_format(self) -> torch.dtype:
        """The format whose range gradients must fit (FP8 E5M2 for ``fp8-*``)."""
        return FP8_E5M2 if self.policy.fp8_recipe else self.policy.compute_dtype

    @property
    def scaler_options(self) -> dict[str, Any]:
        """The loss-scaler settings as ``GradScaler`` keyword arguments."""
        return dict(self.scaler)

    @property
    def notes(self) -> tuple[str, ...]:
        """What building the recipe chose on the user's behalf, for the run log."""
        if not self.resolved_from:
            return ()
        stored = dtype_name(self.policy.param_dtype)
        return (f"precision {self.name}: the optimizer stores parameters in {stored} "
                "(fp16_params=True) and keeps FP32 masters",)

    def micro_config(self, fmt: str) -> MicroConfig:
        """The :class:`MicroConfig` of micro format ``fmt`` with the policy's options."""
        for f, config in self.micro:
            if f == fmt:
                return config
        return MicroConfig.from_recipe(fmt, **dict(self.policy.micro_options))

    def check_optimizer(self, optimizer: Any) -> None:
        """Refuse, in one line, an optimizer that stores the parameters in another 16-bit dtype
        than this recipe (``fp16_params=True``): the recipe is fixed once built."""
        stored = getattr(optimizer, "param_dtype", None)
        if stored not in _LOW or stored == self.policy.param_dtype:
            return
        wanted = _TRUE_MODE[stored]
        raise ConfigError(
            f"the optimizer stores parameters in {dtype_name(stored)} (fp16_params=True) but "
            f"precision '{self.name}' keeps {dtype_name(self.policy.param_dtype)} parameters; use "
            f"precision '{wanted}' (or build the Precision with the optimizer, "
            "mixprec.Precision('auto', optimizer=optimizer)), or build the optimizer without fp16_params")

    def __str__(self) -> str:
        return _io.describe(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (str, bool, int, float, lists, dicts) that :meth:`from_dict` rebuilds this
        recipe from; what ``config.toml``'s ``[recipe]`` table holds."""
        return _io.to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Recipe":
        """The recipe :meth:`to_dict` wrote (unknown keys refused in one line)."""
        return _io.from_dict(cls, data)

    def to_toml(self, table: str = "recipe") -> str:
        """The recipe as a TOML table ``[table]`` (with sub-tables), read back by :meth:`from_toml`."""
        return _io.to_toml(self, table)

    @classmethod
    def from_toml(cls, text: str | dict[str, Any], table: str = "recipe") -> "Recipe":
        """The recipe of TOML text holding a ``[table]`` (or of the parsed table itself)."""
        return _io.from_toml(cls, text, table)

    def replace(self, **changes: Any) -> "Recipe":
        """A new recipe with some choices changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _scaler_pairs(opts: Any) -> tuple[tuple[str, Any], ...]:
    """The loss-scaler settings as pairs, each checked (with ``DynamicLossScaler``'s one-line
    errors) when the recipe is built."""
    pairs = tuple((str(k), v) for k, v in (opts.items() if isinstance(opts, dict) else opts))
    for key, _ in pairs:
        if key not in _SCALER_ARGS:
            raise ConfigError(f"unknown loss-scaler setting '{key}'{closest(key, _SCALER_ARGS)}; "
                              f"valid: {', '.join(_SCALER_ARGS)}")
    settings = {**_SCALER_ARGS, **dict(pairs)}
    DynamicLossScaler(settings["init_scale"], settings["growth_factor"], settings["growth_interval"],
                      backoff_factor=settings["backoff_factor"], hysteresis=settings["hysteresis"],
                      min_scale=settings["min_scale"], max_scale=settings["max_scale"],
                      on_min_scale=settings["on_min_scale"])   # its one-line errors, now
    return pairs


def _build(cls: type[Recipe], precision: Any, *, device: torch.device | str | None, overrides: Any,
           micro_options: Any, optimizer: torch.optim.Optimizer | None, split_masters: bool,
           moments: str, fp8_activations: bool, **scaler_options: Any) -> Recipe:
    """:meth:`Recipe.build`'s work."""
    if isinstance(precision, Recipe):
        return precision
    device = torch.device(device) if device is not None else None
    policy = get_policy(precision, device=device)
    extra = normalize_overrides(overrides)
    if extra:
        # A pair given twice (a resumed plan run's [overrides] and the same plan:PATH again)
        # is kept once: first match wins, so a later identical pair never decided anything.
        policy = policy.replace(name=policy.name, overrides=extra + tuple(
            o for o in policy.overrides if o not in extra))
    if micro_options:
        policy = policy.replace(name=policy.name, micro_options=parse_micro_options(micro_options))
    resolved_from = ""
    stored = getattr(optimizer, "param_dtype", None)
    if stored in _LOW and stored != policy.param_dtype:
        wanted = _TRUE_MODE[stored]
        if not is_auto(precision):
            name = policy.name if policy.name != "custom" else policy.spec()
            raise ConfigError(
                f"the optimizer stores parameters in {dtype_name(stored)} (fp16_params=True) but "
                f"precision '{name}' keeps {dtype_name(policy.param_dtype)} parameters; use "
                f"precision '{wanted}', or build the optimizer without fp16_params")
        resolved_from = policy.name
        policy = get_policy(wanted).replace(name=wanted, overrides=policy.overrides,
                                            micro_options=policy.micro_options, plan=policy.plan)
    return cls(policy=policy, split_masters=split_masters, moments=moments,
               fp8_activations=fp8_activations, scaler=scaler_options, resolved_from=resolved_from)
