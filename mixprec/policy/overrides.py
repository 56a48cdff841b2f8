"""Per-module precision overrides: which format each Linear layer computes in.

An override is a pair ``(pattern, format)``. ``pattern`` is an ``fnmatch`` pattern matched against
a module's qualified name *and the names of its parents*, so ``"blocks.0"`` and ``"blocks.0.*"``
both cover every layer inside ``blocks.0``. ``format`` is one of :data:`LAYER_FORMATS`:

* ``fp32``  autocast off for the layer, inputs (and 16-bit weights) upcast to FP32; a layer kept
  in FP32 also stores FP32 parameters,
* ``bf16`` / ``fp16``  the layer's GEMM runs under autocast to that dtype,
* ``fp8-tensorwise`` / ``fp8-delayed`` / ``fp8-rowwise`` / ``fp8-blockwise``  the layer becomes an
  :class:`mixprec.formats.Fp8Linear` with that recipe (where the FP8 rules allow: the output head,
  MoE gates and layers whose features are not multiples of 16 stay out, and the FP8 report says
  why),
* ``mxfp8`` / ``nvfp4`` / ``mxfp4``  the layer becomes a :class:`mixprec.formats.MicroLinear`
  (block-scaled OCP MX / NVIDIA NVFP4 GEMMs, emulated; the same rules keep layers out, and MX
  formats also need features that are multiples of 32).

**Order: the first matching pattern wins** (as in a routing table): put specific patterns before
broad ones, e.g. ``(("blocks.0.mlp.fc", "fp32"), ("blocks.0.*", "bf16"))``.

A *plan file* (written by ``mixprec plan``, or by hand) holds a base precision and the overrides.
JSON::

    {"precision": "fp8-blockwise", "overrides": [["head", "bf16"], ["blocks.0.*", "bf16"]]}

or TOML::

    precision = "fp8-blockwise"
    [overrides]
    "head" = "bf16"
    "blocks.0.*" = "bf16"

(TOML tables keep their order, so first-match-wins holds there too.) ``precision="plan:PATH"``
loads one (:func:`mixprec.get_policy`).

A plan written by ``mixprec plan`` / ``mixprec whatif --plan`` also records what it was made for:
``made_for`` (the model settings, ``"model=tiny"``) and ``linears`` (every Linear layer's name in
that model). A model whose Linear layers are not those is refused when the plan is applied
(:meth:`PlanOrigin.check`); a plan file without them (older, or written by hand) is not checked.
"""
from __future__ import annotations

import fnmatch
import json
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mixprec.errors import ConfigError, closest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["LAYER_FORMATS", "MICRO_FORMATS", "is_micro", "Overrides", "parse_format", "normalize_overrides", "match_override",
           "check_patterns", "format_dtype", "load_plan", "load_plan_origin", "write_plan", "PLAN_PREFIX",
           "PlanOrigin"]

MICRO_FORMATS: tuple[str, ...] = ("mxfp8", "nvfp4", "mxfp4")
"""The block-scaled formats (:mod:`mixprec.formats`): MXFP8, NVFP4, MXFP4."""

LAYER_FORMATS: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8-tensorwise", "fp8-delayed",
                                  "fp8-rowwise", "fp8-blockwise", *MICRO_FORMATS)
"""The compute formats a layer can be given, cheapest last."""

Overrides = tuple[tuple[str, str], ...]

PLAN_PREFIX = "plan:"

_FORMAT_ALIASES: dict[str, str] = {
    "f32": "fp32", "float32": "fp32", "32": "fp32", "32-true": "fp32", "float": "fp32",
    "bfloat16": "bf16", "bf16-mixed": "bf16",
    "f16": "fp16", "float16": "fp16", "half": "fp16", "16-mixed": "fp16",
    **{f.removeprefix("fp8-"): f for f in LAYER_FORMATS if f.startswith("fp8-")},
    **{f: f for f in LAYER_FORMATS},
}

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_format(name: str) -> str:
    """A user's spelling of a layer format (``bf16``, ``bfloat16``, ``blockwise``, ...) -> its
    canonical name in :data:`LAYER_FORMATS`."""
    key = str(name).strip().lower()
    if key not in _FORMAT_ALIASES:
        raise ConfigError(f"unknown layer format '{name}'{closest(key, LAYER_FORMATS)}; valid: "
                          f"{', '.join(LAYER_FORMATS)}")
    return _FORMAT_ALIASES[key]


def is_micro(fmt: str) -> bool:
    """A block-scaled micro format (``mxfp8``, ``nvfp4``, ``mxfp4``)."""
    return fmt in MICRO_FORMATS


def format_dtype(fmt: str) -> torch.dtype | None:
    """The torch dtype of a 16/32-bit layer format; None for the FP8 and micro formats."""
    return _DTYPES.get(parse_format(fmt))


def normalize_overrides(overrides: Any) -> Overrides:
    """Ordered ``((pattern, format), ...)`` from a dict, a sequence of pairs, or the command-line
    text ``"pattern=format,pattern=format"`` (``;`` separates too). Formats are checked here."""
    if overrides is None:
        return ()
    if isinstance(overrides, str):
        pairs = []
        for part in overrides.replace(";", ",").split(","):
            if not part.strip():
                continue
            pat, sep, fmt = part.rpartition("=")
            if not sep or not pat.strip():
                raise ConfigError(f"cannot read override '{part}': write pattern=format, e.g. "
                                  "'head=bf16,blocks.0.*=bf16'")
            pairs.append((pat, fmt))
    elif isinstance(overrides, Mapping):
        pairs = list(overrides.items())
    elif isinstance(overrides, Iterable):
        pairs = []
        for item in overrides:
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise ConfigError(f"an override is a (pattern, format) pair, not {item!r}")
            pairs.append(tuple(item))
    else:
        raise ConfigError(f"overrides must be a dict pattern -> format or (pattern, format) pairs, "
                          f"not {type(overrides).__name__}")
    out: list[tuple[str, str]] = []
    for pat, fmt in pairs:
        if not isinstance(pat, str) or not pat.strip():
            raise ConfigError(f"an override pattern must be a non-empty string, not {pat!r}")
        out.append((pat.strip(), parse_format(fmt)))
    return tuple(out)


def _names_to_try(qname: str) -> list[str]:
    parts = qname.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def match_override(overrides: Overrides, qname: str) -> str | None:
    """The format of the first pattern matching ``qname`` or one of its parents; None if none."""
    names = _names_to_try(qname)
    for pat, fmt in overrides:
        if any(fnmatch.fnmatchcase(n, pat) for n in names):
            return fmt
    return None


def check_patterns(overrides: Overrides, layer_names: Iterable[str]) -> None:
    """Refuse a pattern that matches none of ``layer_names`` (a typo would silently do nothing),
    naming the closest layer."""
    layers = list(layer_names)
    for pat, _ in overrides:
        if not any(fnmatch.fnmatchcase(n, pat) for name in layers for n in _names_to_try(name)):
            hint = closest(pat, layers) or (f" (e.g. '{layers[0]}')" if layers else "")
            raise ConfigError(f"precision override '{pat}' matches no Linear layer of this "
                              f"model{hint}; patterns are fnmatch patterns on qualified module "
                              "names (parents count: 'blocks.0' covers blocks.0.*)")


@dataclass(frozen=True, kw_only=True)
class PlanOrigin:
    """What a plan file was made for (module docstring)."""

    path: str
    """The plan file, as given."""
    made_for: str
    """The model settings it was planned with (``"model=tiny"``; empty when not recorded)."""
    linears: tuple[str, ...]
    """Every Linear layer of the model it was planned for."""

    def check(self, layer_names: Iterable[str]) -> None:
        """Refuse, in one line, a model whose Linear layers are not the ones planned for."""
        have = list(layer_names)
        extra = [n for n in have if n not in set(self.linears)]
        missing = [n for n in self.linears if n not in set(have)]
        if not extra and not missing:
            return

        def some(names: list[str]) -> str:
            return ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
        differs = "; ".join(d for d in (
            f"this model has {len(extra)} Linear layers the plan does not know ({some(extra)})" if extra else "",
            f"{len(missing)} planned ones are not in it ({some(missing)})" if missing else "") if d)
        made = f" (made for {self.made_for}, {len(self.linears)} Linear layers)" if self.made_for else ""
        train = f", or train the model it was made for ({self.made_for})" if self.made_for else ""
        raise ConfigError(f"plan {self.path} was made for another model{made}: {differs}; make a "
                          f"plan for this model (mixprec plan with this run's model settings){train}")


def _read_plan(path: str | Path) -> dict:
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"plan file not found: {p} (write one with `mixprec plan`)") from None
    try:
        data = tomllib.loads(raw.decode()) if p.suffix.lower() == ".toml" else json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"plan file {p} is not valid {'TOML' if p.suffix == '.toml' else 'JSON'}: "
                          f"{e}") from None
    if not isinstance(data, dict) or "precision" not in data:
        raise ConfigError(f"plan file {p} needs a 'precision' entry (the base mode) and an "
                          "'overrides' table")
    base = data["precision"]
    if not isinstance(base, str) or base.strip().lower().startswith(PLAN_PREFIX):
        raise ConfigError(f"plan file {p}: 'precision' must name a mode such as 'fp8-blockwise'")
    return data


def load_plan(path: str | Path) -> tuple[str, Overrides]:
    """(base precision, overrides) of a plan file (JSON or TOML, see the module docstring)."""
    data = _read_plan(path)
    return data["precision"], normalize_overrides(data.get("overrides", ()))


def load_plan_origin(path: str | Path) -> PlanOrigin | None:
    """What a plan file was made for; None when it does not say (an older or hand-written one)."""
    data = _read_plan(path)
    linears = data.get("linears")
    if not isinstance(linears, list) or not all(isinstance(n, str) for n in linears):
        return None
    made_for = data.get("made_for", "")
    return PlanOrigin(path=str(path), made_for=made_for if isinstance(made_for, str) else "",
                      linears=tuple(linears))


def write_plan(path: str | Path, base: str, overrides: Overrides, *, made_for: str = "",
               linears: Iterable[str] | None = None, **extra: Any) -> Path:
    """Write a plan file (JSON, or TOML when ``path`` ends in ``.toml``). ``made_for`` (the model
    settings) and ``linears`` (the model's Linear layer names) record what it was made for, in both
    forms; ``extra`` entries (the planner's measurements) go into the JSON form only."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    origin: dict[str, Any] = {}
    if linears is not None:
        origin = {"made_for": made_for, "linears": list(linears)}
    if p.suffix.lower() == ".toml":
        lines = [f"precision = {json.dumps(base)}"]
        lines += [f"{k} = {json.dumps(v)}" for k, v in origin.items()]
        lines += ["", "[overrides]"]
        lines += [f"{json.dumps(pat)} = {json.dumps(fmt)}" for pat, fmt in overrides]
        p.write_text("\n".join(lines) + "\n")
    else:
        p.write_text(json.dumps({"precision": base, **origin, "overrides": [list(o) for o in overrides],
                                 **extra}, indent=1) + "\n")
    return p
