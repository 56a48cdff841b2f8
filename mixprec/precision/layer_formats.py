"""Module surgery behind per-layer formats: give each Linear the module its format needs.

:class:`mixprec.Precision` decides each layer's format (:meth:`~mixprec.Precision.requested_format`,
:meth:`~mixprec.Precision.format_for`); these helpers carry the decision out, always reusing the
layer's Parameters (checkpoints, FP32 masters and optimizer state stay valid):

* FP8 formats -> :class:`mixprec.formats.Fp8Linear` (asked per module through
  ``convert_to_fp8(config_fn=...)``),
* micro formats (``mxfp8``, ``mxfp4``, ``nvfp4``) -> :class:`mixprec.formats.MicroLinear`
  (through ``convert_to_micro``),
* a 16/32-bit format other than the surrounding one -> :class:`mixprec.nn.FormatLinear`,
* the surrounding format -> a plain ``nn.Linear``.

Whether a layer may take an FP8 or micro format is the one eligibility function's answer
(:func:`mixprec.precision.eligibility.refusal`), asked by the conversions at set-up and by
:func:`swap_layer` for a later switch (re-planning, the guard): a refused layer keeps the
surrounding format.
"""
from __future__ import annotations

from typing import Any, Protocol

from torch import nn

from mixprec.errors import ConfigError
from mixprec.nn.swap import replace_module
from mixprec.policy.overrides import is_micro
from mixprec.precision.eligibility import model_facts, refusal
from mixprec.precision.rules import is_gemm_layer

__all__ = ["apply_formats", "swap_layer", "is_gemm_layer"]


class Precision(Protocol):
    """What these helpers read of :class:`mixprec.Precision` (which calls them, so they do not
    import it back)."""

    policy: Any
    base_format: str
    fp8_config: Any
    fp8_report: Any

    def requested_format(self, qualified_name: str) -> str: ...

    def format_for(self, qualified_name: str, module: nn.Module) -> str: ...

    def keep_fp32_reason(self, qualified_name: str, module: nn.Module) -> str | None: ...




def apply_formats(precision: Precision, model: nn.Module) -> dict[str, str]:
    """Set every Linear of ``model`` up in its requested format; return name -> resolved format."""
    from mixprec.nn import FormatLinear
    wanted = {n: precision.requested_format(n) for n, m in model.named_modules() if is_gemm_layer(m)}
    if any(f.startswith("fp8-") for f in wanted.values()):
        from mixprec.formats import Fp8Config
        from mixprec.precision.convert import convert_to_fp8
        configs = {f: Fp8Config.from_recipe(f) for f in set(wanted.values()) if f.startswith("fp8-")}
        base = precision.fp8_config or next(iter(configs.values()))
        precision.fp8_report = convert_to_fp8(
            model, config=base, policy=precision.policy,
            config_fn=lambda module, name: configs.get(wanted.get(name, "")))
    if any(is_micro(f) for f in wanted.values()):
        from mixprec.precision.convert import convert_to_micro
        configs = {f: precision.micro_config(f) for f in set(wanted.values()) if is_micro(f)}
        precision.micro_report = convert_to_micro(
            model, config_fn=lambda name: configs.get(wanted.get(name, "")),
            keeps_fp32=precision.keep_fp32_reason,
            explicit={n for n in wanted if precision.policy.override_for(n) is not None})
    modules = dict(model.named_modules())
    for name, module in list(modules.items()):
        if not isinstance(module, nn.Linear):
            continue
        fmt = wanted.get(name, precision.base_format)
        if not fmt.startswith("fp8-") and not is_micro(fmt) and fmt != precision.base_format \
                and type(module) is nn.Linear:
            parent, _, child = name.rpartition(".")
            replace_module(modules[parent], child, FormatLinear.from_linear(module, fmt))
    formats: dict[str, str] = {}
    for name, module in model.named_modules():
        if is_gemm_layer(module):
            formats[name] = (precision.base_format if type(module) is nn.Linear
                             else precision.format_for(name, module))
    return formats


def swap_layer(precision: Precision, model: nn.Module, qualified_name: str, fmt: str) -> str:
    """Replace the Linear ``qualified_name`` by the module ``fmt`` needs; return its format."""
    from mixprec.formats import Fp8Config, Fp8Linear, MicroLinear
    from mixprec.nn import FormatLinear
    from mixprec.policy.overrides import parse_format
    fmt = parse_format(fmt)
    parent_name, _, child = qualified_name.rpartition(".")
    parent = model.get_submodule(parent_name)
    old = getattr(parent, child)
    if not isinstance(old, nn.Linear):
        raise ConfigError(f"'{qualified_name}' is not a Linear layer ({type(old).__name__})")
    if precision.format_for(qualified_name, old) == fmt:
        return fmt
    plain = nn.Linear(old.in_features, old.out_features, bias=old.bias is not None, device="meta")
    plain.weight, plain.bias = old.weight, old.bias
    plain.train(old.training)
    new: nn.Module = plain
    config = (precision.micro_config(fmt) if is_micro(fmt) else
              Fp8Config.from_recipe(fmt) if fmt.startswith("fp8-") else None)
    if config is not None:
        # Asked for this layer by name: a recipe's first/last-blocks rule does not apply.
        why = refusal(qualified_name, plain, config, model_facts(model),
                      keeps_fp32=precision.keep_fp32_reason, explicit=True)
        if why is None:
            make = MicroLinear.from_linear if is_micro(fmt) else Fp8Linear.from_linear
            new = make(plain, config, fqn=qualified_name)
    elif fmt != precision.base_format:
        new = FormatLinear.from_linear(plain, fmt)
    replace_module(parent, child, new)
    return precision.base_format if type(new) is nn.Linear else precision.format_for(qualified_name, new)
