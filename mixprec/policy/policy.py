"""The precision policy: the one object that decides every dtype in a training run.

A :class:`Policy` names four dtypes and the modules exempt from them:

* ``param_dtype``   what the model's parameters are stored in (FP32 masters live in the optimizer
                    when this is lower than FP32),
* ``compute_dtype`` what the math runs in (applied by :func:`mixprec.autocast`),
* ``output_dtype``  what the model's outputs are cast to (the loss is always computed in FP32),
* ``reduce_dtype``  what gradients are reduced in across ranks.

Which modules keep FP32 parameters is a rule of the rule book, :mod:`mixprec.precision.rules`
(norm layers unless ``keep_norms_fp32=False``, MoE gates/routers, modules with a truthy
``keep_in_fp32``, ``keep_fp32_names`` patterns and ``keep_fp32_types``); the policy only holds
the data those rules read.

A policy is data. :class:`mixprec.Precision` (``mixprec/precision/precision.py``) is the one place
that turns it into decisions: casting, masters, loss scaling, FP8, what strategies need.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.errors import ConfigError, closest
from mixprec.policy import hardware
from mixprec.policy.dtypes import dtype_name, parse_dtype
from mixprec.policy.overrides import (MICRO_FORMATS, PLAN_PREFIX, Overrides, PlanOrigin, load_plan,
                                      load_plan_origin, match_override,
                                      normalize_overrides)

__all__ = ["Policy", "get_policy", "PRESETS", "ALIASES", "FP8_RECIPES", "MICRO_FORMATS"]

_F32, _BF16, _F16 = torch.float32, torch.bfloat16, torch.float16
_LOW = (_BF16, _F16)

FP8_RECIPES: tuple[str, ...] = ("fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "fp8-blockwise")
"""Policy names of the FP8 recipes; ``fp8_recipe`` is the part after ``fp8-``
(``mixprec.formats.Fp8Config.from_recipe`` builds the recipe itself)."""


@dataclass(frozen=True, kw_only=True)
class Policy:
    """Which dtype each part of training uses. Build one with :func:`get_policy`."""

    name: str = "custom"
    """Preset name, or ``"custom"``; shown in logs."""
    param_dtype: torch.dtype = _F32
    """Storage dtype of the model's parameters."""
    compute_dtype: torch.dtype = _F32
    """Dtype of the matmuls and convolutions (autocast target)."""
    output_dtype: torch.dtype = _F32
    """Dtype the model's outputs are cast to before the loss (which is computed in FP32)."""
    reduce_dtype: torch.dtype = _F32
    """Dtype of gradient all-reduce / reduce-scatter across ranks."""
    master_weights: bool | None = None
    """Keep FP32 master copies in the optimizer. Default: yes whenever ``param_dtype`` is below FP32."""
    loss_scaling: bool | None = None
    """Dynamic loss scaling. Default: on whenever FP16 is the param or compute dtype."""
    allow_tf32: bool = False
    """Let FP32 matmuls run on TF32 tensor cores (CUDA Ampere and newer)."""
    fp8_recipe: str | None = None
    """Name of an FP8 recipe (``mixprec.formats.Fp8Config.from_recipe``) for Linear layers, or None."""
    micro_format: str | None = None
    """A block-scaled format for Linear layers (``mxfp8``, ``mxfp4``, ``nvfp4``;
    :mod:`mixprec.formats`), or None."""
    micro_options: tuple[tuple[str, Any], ...] = ()
    """Changes to the micro-format recipe, ``(("hadamard_wgrad", False), ...)`` (fields of
    :class:`mixprec.formats.MicroConfig`; :class:`mixprec.Precision` checks them). Also accepts a
    dict."""
    keep_norms_fp32: bool = True
    """Norm layers (torch's and any that look like one, :func:`mixprec.precision.rules.is_norm`)
    keep FP32 parameters."""
    keep_fp32_types: tuple[type[nn.Module], ...] = ()
    """Further module types whose own parameters stay FP32."""
    keep_fp32_names: tuple[str, ...] = ()
    """``fnmatch`` patterns of qualified module names whose parameters stay FP32."""
    overrides: Overrides = ()
    """Per-module compute formats, ordered ``((pattern, format), ...)``; the first pattern matching
    a layer's name (or a parent's) wins. Formats: ``fp32``, ``bf16``, ``fp16``, ``fp8-<recipe>``
    (see :mod:`mixprec.policy.overrides`). Also accepts a dict (its order is kept)."""
    plan: PlanOrigin | None = field(default=None, compare=False)
    """What the plan file these overrides came from was made for (``plan:PATH``; None otherwise):
    :class:`mixprec.Precision` refuses a model whose Linear layers are not the planned ones."""

    def __post_init__(self) -> None:
        for f in ("param_dtype", "compute_dtype", "output_dtype", "reduce_dtype"):
            dt = parse_dtype(getattr(self, f))
            if dt not in (_F32, _BF16, _F16):
                raise ConfigError(f"Policy.{f} must be fp32, bf16 or fp16, not {dtype_name(dt)} "
                                  "(FP8 is set with fp8_recipe, e.g. get_policy('fp8-blockwise'))")
            object.__setattr__(self, f, dt)
        if self.master_weights is None:
            object.__setattr__(self, "master_weights", self.param_dtype in _LOW)
        if self.param_dtype == _F16 and self.compute_dtype == _BF16 or \
           self.param_dtype == _BF16 and self.compute_dtype == _F16:
            raise ConfigError(f"param dtype {dtype_name(self.param_dtype)} with compute dtype "
                              f"{dtype_name(self.compute_dtype)} casts between two 16-bit formats "
                              "on every use; pick one of them for both, or keep params in fp32")
        recipes = [r.removeprefix("fp8-") for r in FP8_RECIPES]
        if self.fp8_recipe is not None:   # "fp8-blockwise" and "blockwise" name the same recipe
            object.__setattr__(self, "fp8_recipe", str(self.fp8_recipe).removeprefix("fp8-"))
        if self.fp8_recipe is not None and self.fp8_recipe not in recipes:
            raise ConfigError(f"unknown fp8_recipe '{self.fp8_recipe}'{closest(self.fp8_recipe, recipes)}"
                              f"; valid: {', '.join(recipes)}")
        if self.micro_format is not None and self.micro_format not in MICRO_FORMATS:
            raise ConfigError(f"unknown micro_format '{self.micro_format}'"
                              f"{closest(str(self.micro_format), MICRO_FORMATS)}; valid: {', '.join(MICRO_FORMATS)}")
        if self.micro_format and self.fp8_recipe:
            raise ConfigError("a policy has either an fp8_recipe or a micro_format, not both; give "
                              "single layers the other one with overrides")
        opts = self.micro_options
        object.__setattr__(self, "micro_options", tuple(
            (str(k), v) for k, v in (opts.items() if isinstance(opts, dict) else opts)))
        object.__setattr__(self, "keep_fp32_types", tuple(self.keep_fp32_types))
        object.__setattr__(self, "keep_fp32_names", tuple(self.keep_fp32_names))
        object.__setattr__(self, "overrides", normalize_overrides(self.overrides))
        if self.loss_scaling is None:
            object.__setattr__(self, "loss_scaling", self._derived_loss_scaling())

    # --- what the rest of mixprec asks --------------------------------------------------------

    @property
    def is_mixed(self) -> bool:
        """True when the math runs below FP32 (an autocast region is needed)."""
        return self.compute_dtype != _F32

    @property
    def low_precision_params(self) -> bool:
        return self.param_dtype in _LOW

    def override_for(self, qualified_name: str) -> str | None:
        """The compute format an override gives this module (first match wins), or None."""
        return match_override(self.overrides, qualified_name)

    def cast_output(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.output_dtype) if x.is_floating_point() else x

    def replace(self, **changes) -> "Policy":
        """A copy with some fields changed (and ``name`` reset to ``"custom"`` unless given)."""
        changes.setdefault("name", "custom")
        if "loss_scaling" not in changes and self.loss_scaling == self._derived_loss_scaling():
            changes["loss_scaling"] = None   # derived, not chosen: derive it again (fp16 overrides)
        return dataclasses.replace(self, **changes)

    @property
    def uses_fp16(self) -> bool:
        """FP16 is used somewhere: as the param or compute dtype, or by a per-layer override."""
        return _F16 in (self.param_dtype, self.compute_dtype) or \
            any(fmt == "fp16" for _, fmt in self.overrides)

    def _derived_loss_scaling(self) -> bool:
        return self.uses_fp16

    def spec(self) -> str:
        """The compact form, e.g. ``p=f32,c=bf16,o=f32,r=f32``."""
        s = ",".join(f"{k}={_compact(getattr(self, f))}" for k, f in
                     (("p", "param_dtype"), ("c", "compute_dtype"), ("o", "output_dtype"),
                      ("r", "reduce_dtype")))
        s += f",fp8={self.fp8_recipe}" if self.fp8_recipe else ""
        s += f",micro={self.micro_format}" if self.micro_format else ""
        if self.micro_options:
            s += "(" + ",".join(f"{k}={v}" for k, v in self.micro_options) + ")"
        return s

    def describe(self) -> str:
        """One line for logs: name, dtypes, masters, loss scaling."""
        extras = [f"master weights {'fp32' if self.master_weights else 'off'}",
                  f"loss scaling {'dynamic' if self.loss_scaling else 'off'}"]
        if self.allow_tf32:
            extras.append("tf32 matmuls")
        if self.overrides:
            extras.append("overrides (first match wins) " +
                          ", ".join(f"{pat}={fmt}" for pat, fmt in self.overrides))
        return f"{self.name} ({self.spec()}; {', '.join(extras)})"

    def __str__(self) -> str:
        name = self.name if self.name != "custom" else self.spec()
        return f"{name}+{len(self.overrides)} overrides" if self.overrides else name


def _compact(dt: torch.dtype) -> str:
    return {_F32: "f32", _BF16: "bf16", _F16: "f16"}[dt]


PRESETS: dict[str, Policy] = {
    p.name: p for p in (
        Policy(name="32-true"),
        Policy(name="tf32", allow_tf32=True),
        Policy(name="bf16-mixed", compute_dtype=_BF16),
        Policy(name="16-mixed", compute_dtype=_F16),
        # "true" modes store params in 16 bits; unlike some peers we keep FP32 masters by default
        # (master_weights=True), because sub-ULP updates are lost otherwise.
        Policy(name="bf16-true", param_dtype=_BF16, compute_dtype=_BF16, output_dtype=_BF16),
        Policy(name="16-true", param_dtype=_F16, compute_dtype=_F16, output_dtype=_F16),
        # FP8 GEMMs in eligible Linear layers; every other op autocasts to BF16, params stay FP32.
        *(Policy(name=n, compute_dtype=_BF16, fp8_recipe=n.removeprefix("fp8-")) for n in FP8_RECIPES),
        # Block-scaled GEMMs (MXFP8 / MXFP4 / NVFP4) in eligible Linears; the rest as for FP8.
        *(Policy(name=n, compute_dtype=_BF16, micro_format=n) for n in MICRO_FORMATS),
    )
}

ALIASES: dict[str, str] = {
    "fp32": "32-true", "32": "32-true", "no": "32-true", "float32": "32-true", "32-true": "32-true",
    "full": "32-true",
    "bf16": "bf16-mixed", "mixed_bfloat16": "bf16-mixed", "bf16-mixed": "bf16-mixed",
    "fp16": "16-mixed", "16": "16-mixed", "mixed_float16": "16-mixed", "16-mixed": "16-mixed",
    "fp16-mixed": "16-mixed",
    "tf32": "tf32", "bf16-true": "bf16-true", "16-true": "16-true", "fp16-true": "16-true",
    **{n: n for n in FP8_RECIPES},
    **{n: n for n in MICRO_FORMATS},
}



_KEYS = {"p": "param_dtype", "param": "param_dtype", "params": "param_dtype",
         "c": "compute_dtype", "compute": "compute_dtype",
         "o": "output_dtype", "output": "output_dtype",
         "r": "reduce_dtype", "reduce": "reduce_dtype"}


def _parse_compact(spec: str) -> Policy:
    fields: dict[str, torch.dtype] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in _KEYS:
            raise ConfigError(f"cannot read '{part}' in policy '{spec}': use key=dtype with keys "
                              "p (params), c (compute), o (output), r (reduce), e.g. "
                              "'p=f32,c=bf16,o=f32'")
        fields[_KEYS[key]] = parse_dtype(value)
    p = fields.get("param_dtype", _F32)
    c = fields.get("compute_dtype", p)
    o = fields.get("output_dtype", p)
    r = fields.get("reduce_dtype", _F32)
    for preset in PRESETS.values():
        if (preset.param_dtype, preset.compute_dtype, preset.output_dtype,
                preset.reduce_dtype) == (p, c, o, r) and not (preset.allow_tf32 or preset.fp8_recipe):
            return preset
    return Policy(param_dtype=p, compute_dtype=c, output_dtype=o, reduce_dtype=r)


def _best_safe(device: torch.device | None = None) -> Policy:
    device = device or hardware.default_device()
    if device.type == "cuda":
        return PRESETS["bf16-mixed"] if hardware.cuda_supports_bf16() else PRESETS["16-mixed"]
    # On a CPU without BF16 instructions BF16 GEMMs are emulated and far slower than FP32:
    # full precision is both the safe and the fast choice there.
    return PRESETS["bf16-mixed"] if hardware.cpu_has_native_bf16() else PRESETS["32-true"]


def get_policy(name: str | Policy | bool | None = True, *,
               device: torch.device | str | None = None) -> Policy:
    """Resolve a user's precision setting into a :class:`Policy`.

    Accepts a ``Policy``; a preset name (``32-true``, ``tf32``, ``bf16-mixed``, ``16-mixed``,
    ``bf16-true``, ``16-true``, ``fp8-*``, ``mxfp8``, ``mxfp4``, ``nvfp4``); an alias other tools use (``fp32``, ``no``, ``bf16``,
    ``fp16``, ``mixed_float16``, ``mixed_bfloat16``); the compact form ``p=f32,c=bf16,o=f32``;
    ``plan:PATH`` for a plan file (a base mode plus per-module overrides, written by
    ``mixprec plan``); ``True`` for the best safe mixed mode on ``device`` (BF16 where the hardware runs it natively,
    FP16 with loss scaling on older GPUs, FP32 on CPUs that only emulate BF16); ``False``/``None``
    for FP32.
    """
    if isinstance(name, Policy):
        return name
    if name is True:
        return _best_safe(torch.device(device) if device is not None else None)
    if name is False or name is None:
        return PRESETS["32-true"]
    if not isinstance(name, str):
        raise ConfigError(f"precision must be a name, a Policy or a bool, not {type(name).__name__}")
    key = name.strip().lower()
    if key.startswith(PLAN_PREFIX):
        path = name.strip()[len(PLAN_PREFIX):]
        base, overrides = load_plan(path)
        policy = get_policy(base, device=device)
        return policy.replace(name=policy.name, overrides=overrides, plan=load_plan_origin(path))
    if key in ("true", "auto", "best"):
        return _best_safe(torch.device(device) if device is not None else None)
    if "=" in key:
        return _parse_compact(key)
    if key in ALIASES:
        return PRESETS[ALIASES[key]]
    valid = sorted(set(PRESETS) | set(ALIASES))
    raise ConfigError(f"unknown precision '{name}'{precision_hint(key)}; valid: {', '.join(valid)}, "
                      "or the compact form 'p=f32,c=bf16,o=f32'")


# The number format a precision name (or a typo of one) is about, most specific first: a
# "did you mean" must never cross formats (following it would train in another format).
_FORMAT_OF: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("tf32", re.compile(r"tf32")),
    ("bf16", re.compile(r"bf|bfloat")),
    ("nvfp4", re.compile(r"^nv")),
    ("mxfp4", re.compile(r"^mx\D*4")),
    ("mxfp8", re.compile(r"^mx\D*8")),
    ("fp8", re.compile(r"fp8|float8|e4m3|e5m2")),
    ("fp16", re.compile(r"16|half")),
    ("fp32", re.compile(r"32|^no$|^full$")),
)


def number_format_of(name: str) -> str | None:
    """The number format a precision name is about (``"fp16"`` for ``fp16-mixd``), or None."""
    return next((fmt for fmt, pattern in _FORMAT_OF if pattern.search(name.lower())), None)


def precision_hint(key: str) -> str:
    """The "did you mean" for an unknown precision name, never in another number format.

    Only names of the format the typo names are candidates (``fp16-mixd`` -> ``fp16-mixed``, never
    ``bf16-mixed``); a bare format with several modes (``fp8``) lists them all.
    """
    names = sorted(set(PRESETS) | set(ALIASES))
    fmt = number_format_of(key)
    same = [n for n in names if fmt is None or number_format_of(n) == fmt]
    hint = closest(key, same)
    if hint or fmt is None:
        return hint
    modes = [n for n in PRESETS if number_format_of(n) == fmt]
    return f" (did you mean one of {', '.join(repr(m) for m in modes)}?)" if len(modes) > 1 else ""
