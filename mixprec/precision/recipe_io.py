"""Printing and serialising a :class:`~mixprec.precision.recipe.Recipe`: its readable block
(``str(recipe)``), its plain-data form (``to_dict`` / ``from_dict``) and its TOML table (the
``[recipe]`` table of a run's ``config.toml``). The ``Recipe`` methods of the same names call these
(``recipe``: a ``Recipe``; ``cls``: the class, handed in: recipe.py imports this module, not the
other way round)."""
from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
from typing import Any

from mixprec.amp import GradScaler
from mixprec.errors import ConfigError, closest
from mixprec.formats.micro_config import parse_micro_options
from mixprec.policy.dtypes import dtype_name, parse_dtype
from mixprec.policy.overrides import PlanOrigin, normalize_overrides
from mixprec.policy.policy import Policy

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["describe", "to_dict", "from_dict", "to_toml", "from_toml"]

SCALER_ARGS = {n: p.default for n, p in inspect.signature(GradScaler.__init__).parameters.items()
               if n not in ("self", "enabled", "device")}
"""The loss-scale settings a recipe holds (``GradScaler``'s), with their defaults (``enabled`` is
the policy's ``loss_scaling``; ``device`` the Precision's)."""


def describe(recipe: Any) -> str:
    """The recipe as one readable block (``str(recipe)``)."""
    p = recipe.policy
    dts = ", ".join(f"{k} {dtype_name(getattr(p, f))}" for k, f in (
        ("params", "param_dtype"), ("compute", "compute_dtype"), ("output", "output_dtype"),
        ("reduce", "reduce_dtype")))
    masters = {"none": "none", "full": "full FP32 copies",
               "split": "split (the BF16 parameter + a 16-bit remainder)"}[recipe.masters]
    if recipe.policy.low_precision_params and not recipe.keeps_masters:
        masters = "none (16-bit parameters updated in place: master_weights=False)"
    scale = "off"
    if recipe.scales_loss:
        s = {**SCALER_ARGS, **dict(recipe.scaler)}
        scale = (f"dynamic (init {s['init_scale']:g}, growth every {s['growth_interval']} clean "
                 f"steps, hysteresis {s['hysteresis']}, min {s['min_scale']:g}, "
                 f"stuck: {s['on_min_scale']})")
    kept = ["norms" if p.keep_norms_fp32 else "", *p.keep_fp32_names,
            *(t.__name__ for t in p.keep_fp32_types)]
    rows = [("dtypes", dts), ("masters", masters), ("moments", recipe.moments),
            ("activations", "saved in FP8 E4M3 (fp8_activations)" if recipe.fp8_activations
             else "saved as computed"),
            ("loss scale", scale), ("tf32", "on" if p.allow_tf32 else "off"),
            ("fp8", f"{recipe.fp8.recipe}: {recipe.fp8.describe()}" if recipe.fp8 else "-"),
            ("micro", "; ".join(c.describe() for _, c in recipe.micro) or "-"),
            ("kept fp32", ", ".join(k for k in kept if k) or "-"),
            ("overrides", ", ".join(f"{pat}={fmt}" for pat, fmt in p.overrides) + " (first match wins)"
             if p.overrides else "-")]
    if p.plan is not None:
        rows.append(("plan", f"{p.plan.path}" + (f" (made for {p.plan.made_for})" if p.plan.made_for else "")))
    head = f"recipe {recipe.name}" + (f" (asked: {recipe.resolved_from})" if recipe.resolved_from else "")
    return "\n".join([head, *(f"  {k:<12}{v}" for k, v in rows)])


def to_dict(recipe: Any) -> dict[str, Any]:
    """Plain data (str, bool, int, float, lists, dicts) that :meth:`from_dict` rebuilds this
    recipe from; what ``config.toml``'s ``[recipe]`` table holds."""
    p = recipe.policy
    out: dict[str, Any] = {"name": p.name}
    for f in ("param_dtype", "compute_dtype", "output_dtype", "reduce_dtype"):
        out[f] = dtype_name(getattr(p, f))
    out.update(master_weights=bool(p.master_weights), loss_scaling=bool(p.loss_scaling),
               allow_tf32=p.allow_tf32, keep_norms_fp32=p.keep_norms_fp32,
               keep_fp32_names=list(p.keep_fp32_names),
               keep_fp32_types=[f"{t.__module__}:{t.__qualname__}" for t in p.keep_fp32_types],
               masters=recipe.masters, split_masters=recipe.split_masters, moments=recipe.moments,
               fp8_activations=recipe.fp8_activations)
    if p.fp8_recipe:
        out["fp8_recipe"] = p.fp8_recipe
    if p.micro_format:
        out["micro_format"] = p.micro_format
    if recipe.resolved_from:
        out["resolved_from"] = recipe.resolved_from
    if p.micro_options:      # TOML has no None: an "int or None" option is written "none"
        out["micro_options"] = {k: ("none" if v is None else v) for k, v in p.micro_options}
    if recipe.scaler:
        for k, v in recipe.scaler:
            if not isinstance(v, (bool, int, float, str)):
                raise ConfigError(f"the loss-scaler setting {k}={v!r} cannot be written to a "
                                  "recipe table (numbers, true/false and names only)")
        out["scaler"] = dict(recipe.scaler)
    if p.overrides:
        out["overrides"] = dict(p.overrides)
    if p.plan is not None:
        out["plan"] = {"path": p.plan.path, "made_for": p.plan.made_for,
                       "linears": list(p.plan.linears)}
    return out

def from_dict(cls: type, data: dict[str, Any]) -> Any:
    """The recipe :meth:`to_dict` wrote (unknown keys refused in one line)."""
    data = dict(data)
    known = {"name", "param_dtype", "compute_dtype", "output_dtype", "reduce_dtype",
             "master_weights", "loss_scaling", "allow_tf32", "keep_norms_fp32",
             "keep_fp32_names", "keep_fp32_types", "masters", "split_masters", "moments",
             "fp8_activations", "fp8_recipe", "micro_format", "micro_options", "scaler",
             "overrides", "plan", "resolved_from"}
    for key in data:
        if key not in known:
            raise ConfigError(f"unknown recipe key '{key}'{closest(key, known)}; valid: "
                              f"{', '.join(sorted(known))}")
    plan = data.get("plan")
    policy = Policy(
        name=data.get("name", "custom"),
        **{f: parse_dtype(data[f]) for f in ("param_dtype", "compute_dtype", "output_dtype",
                                              "reduce_dtype") if f in data},
        **{f: data[f] for f in ("master_weights", "loss_scaling", "allow_tf32", "keep_norms_fp32",
                                "fp8_recipe", "micro_format") if f in data},
        micro_options=parse_micro_options(data.get("micro_options") or ()),
        keep_fp32_names=tuple(data.get("keep_fp32_names", ())),
        keep_fp32_types=tuple(_import_type(t) for t in data.get("keep_fp32_types", ())),
        overrides=normalize_overrides(data.get("overrides") or ()),
        plan=PlanOrigin(path=plan["path"], made_for=plan.get("made_for", ""),
                        linears=tuple(plan.get("linears", ()))) if plan else None)
    recipe = cls(policy=policy, split_masters=data.get("split_masters", True),
                 moments=data.get("moments", "fp32"),
                 fp8_activations=data.get("fp8_activations", False),
                 scaler=data.get("scaler") or (), resolved_from=data.get("resolved_from", ""))
    if "masters" in data and data["masters"] != recipe.masters:
        raise ConfigError(f"the recipe says masters={data['masters']} but its settings give "
                          f"{recipe.masters}; drop 'masters' (it is derived) or fix split_masters")
    return recipe

def to_toml(recipe: Any, table: str = "recipe") -> str:
    """The recipe as a TOML table ``[table]`` (with sub-tables), read back by :meth:`from_toml`."""
    data = to_dict(recipe)
    subs = {k: data.pop(k) for k in ("micro_options", "scaler", "overrides", "plan") if k in data}
    lines = [f"[{table}]", *(f"{k} = {_toml_value(v)}" for k, v in data.items())]
    for key, sub in subs.items():
        lines += ["", f"[{table}.{key}]", *(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in sub.items())]
    return "\n".join(lines) + "\n"

def from_toml(cls: type, text: str | dict[str, Any], table: str = "recipe") -> Any:
    """The recipe of TOML text holding a ``[table]`` (or of the parsed table itself)."""
    data = tomllib.loads(text) if isinstance(text, str) else text
    if isinstance(text, str):
        if table not in data:
            raise ConfigError(f"no [{table}] table in the TOML text; write one with Recipe.to_toml()")
        data = data[table]
    return from_dict(cls, data)


def _toml_key(k: str) -> str:
    """A bare key where TOML allows one (``init_scale``), else quoted (a pattern ``blocks.0.*``)."""
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v) if v == v and abs(v) != float("inf") else ("nan" if v != v else
                                                                  ("inf" if v > 0 else "-inf"))
    if isinstance(v, int):
        return str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))


def _import_type(path: str) -> type:
    module, _, qual = str(path).partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        raise ConfigError(f"keep_fp32_types: cannot import '{path}' (write module:Class)") from None
    return obj
