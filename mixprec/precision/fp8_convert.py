"""Swap a model's ``nn.Linear`` layers for :class:`Fp8Linear` (and Hugging Face ``Conv1D`` layers,
GPT-2's transposed-weight Linears, for :class:`Fp8Conv1D`), and say what was left alone and why.

What stays in high precision is the rule book's answer (:mod:`mixprec.precision.rules`,
DeepSeek-V3's recipe): embeddings, norms, the output head, MoE gates/routers, modules kept FP32,
and Linears whose in/out features are not multiples of 16. :class:`mixprec.Precision` calls
:func:`convert_to_fp8` when it sets a model up; calling it directly swaps layers without casting.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from mixprec.errors import ConfigError
from mixprec.formats.fp8_config import Fp8Config
from mixprec.formats.fp8_linear import Fp8Conv1D, Fp8Linear, is_conv1d
from mixprec.formats.fp8_path import plan_gemms
from mixprec.nn.swap import replace_module
from mixprec.policy.dtypes import dtype_name
from mixprec.policy.policy import Policy
from mixprec.precision.rules import (GATE_NAMES, HEAD_NAMES, embedding_weights, fp8_skip_reason,
                                     is_norm, keep_fp32_reason)

__all__ = ["convert_to_fp8", "fp8_skip_reason", "Fp8ConversionReport", "HEAD_NAMES",
           "GATE_NAMES"]

@dataclass
class Fp8ConversionReport:
    """What :func:`convert_to_fp8` did."""

    config: Fp8Config
    converted: list[str] = field(default_factory=list)
    """Qualified names of the layers now running their GEMMs in FP8 (``Fp8Linear``, or
    ``Fp8Conv1D`` for a Hugging Face ``Conv1D``)."""
    recipes: dict[str, str] = field(default_factory=dict)
    """Recipe of each converted layer (differs from ``config``'s with per-layer formats)."""
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(qualified name, reason) of Linears, embeddings and norms kept in high precision."""
    high_precision: str = "high precision"
    """What the skipped modules run in: the policy's compute dtype when a policy was given (BF16
    for the ``fp8-*`` presets), else "high precision"."""
    expected_path: str = "emulated"
    """Path the converted layers take, as each decided it at conversion (``Fp8Linear.execution_path``;
    a later move to another device decides again); where layers differ, the count per path
    (``emulated (4 layers), cpu-scaled-mm (2 layers)``, with the recipe where several were
    converted). The start line says ``path: ...``: it was decided, not expected."""
    configs: dict[str, Fp8Config] = field(default_factory=dict)
    """The config of each recipe some layer was converted to, in first-use order."""

    @property
    def num_converted(self) -> int:
        return len(self.converted)

    def what_runs(self) -> str:
        """The converted layers by recipe: the one recipe's description, or, for a plan that
        mixes recipes, each one's count and description (``4 fp8-tensorwise (...), 2
        fp8-blockwise (...)``). No layer converted: the config's description."""
        counts: dict[str, int] = {}
        for name in self.converted:
            recipe = self.recipes.get(name, self.config.recipe)
            counts[recipe] = counts.get(recipe, 0) + 1
        if len(counts) <= 1:
            only = next(iter(counts), self.config.recipe)
            return self.configs.get(only, self.config).describe()
        return ", ".join(f"{n} {self.configs[r].describe() if r in self.configs else 'fp8-' + r}"
                         for r, n in counts.items())

    def kept_summary(self) -> str:
        """What was kept out of FP8, by kind: ``1 Linear (head), 2 embeddings, 5 norms`` (the
        Linears named, up to three). It said ``8 modules kept in high precision`` beside ``Linear
        layers: 8 fp8-tensorwise, 1 bf16``, which read as a contradiction (found by a new-user
        trial): the 8 were the head, the embeddings and the norms."""
        kinds = {"embedding": [], "norm": [], "linear": []}
        for name, why in self.skipped:
            kind = ("embedding" if why.startswith("embedding") else
                    "norm" if why.startswith("normalization") else "linear")
            kinds[kind].append(name)
        parts = []
        if linears := kinds["linear"]:
            named = ", ".join(linears[:3]) + (", ..." if len(linears) > 3 else "")
            parts.append(f"{len(linears)} Linear{'s' if len(linears) != 1 else ''} ({named})")
        for kind, word in (("embedding", "embedding"), ("norm", "norm")):
            if n := len(kinds[kind]):
                parts.append(f"{n} {word}{'s' if n != 1 else ''}")
        return ", ".join(parts)

    def __str__(self) -> str:
        kept = f"; kept in {self.high_precision}: {self.kept_summary()}" if self.skipped else ""
        lines = [f"{self.what_runs()}: {len(self.converted)} Linear layers converted{kept}; path: "
                 f"{self.expected_path}"]
        lines += [f"  fp8   {name}" + (f" ({self.recipes[name]})" if self.recipes.get(name, self.config.recipe)
                                            != self.config.recipe else "") for name in self.converted]
        lines += [f"  skip  {name}: {why}" for name, why in self.skipped]
        return "\n".join(lines)


def convert_to_fp8(model: nn.Module, *, config: Fp8Config,
                   module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
                   policy: Policy | None = None,
                   config_fn: Callable[[nn.Module, str], Fp8Config | None] | None = None,
                   ) -> Fp8ConversionReport:
    """Replace eligible ``nn.Linear`` submodules of ``model`` with :class:`Fp8Linear`, in place,
    and Hugging Face ``Conv1D`` ones (GPT-2; recognised by :func:`~mixprec.formats.fp8_linear.is_conv1d`)
    with :class:`Fp8Conv1D`, which keeps the ``(in, out)`` weight layout and state-dict keys.

    ``module_filter_fn(module, qualified_name) -> bool`` is asked about every layer that passed
    the default rules; False keeps it in high precision. A ``policy`` adds its own FP32 exemptions
    (``Policy.keeps_fp32``). ``config_fn(module, qualified_name)`` (per-layer precision) gives
    each eligible Linear its own recipe, or None to keep it in high precision. Parameters are reused, so an optimizer built before the conversion
    stays valid. Returns a report of converted and skipped modules.
    """
    if not isinstance(config, Fp8Config):
        raise ConfigError(f"config must be an Fp8Config (e.g. Fp8Config.from_recipe('blockwise')), "
                          f"not {type(config).__name__}")
    if type(model) is nn.Linear:
        raise ConfigError("convert_to_fp8 swaps submodules in place; wrap a bare nn.Linear in a "
                          "module (e.g. nn.Sequential(linear)) or use Fp8Linear.from_linear")
    report = Fp8ConversionReport(config=config)
    if policy is not None:
        report.high_precision = f"high precision ({dtype_name(policy.compute_dtype)} compute)"
    embeddings = embedding_weights(model)
    modules = dict(model.named_modules())
    for name, module in list(modules.items()):
        if not name:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name]
        if isinstance(module, nn.Embedding):
            report.skipped.append((name, "embedding (kept in high precision)"))
            continue
        if is_norm(module):
            report.skipped.append((name, "normalization layer (kept in high precision)"))
            continue
        if isinstance(module, (Fp8Linear, Fp8Conv1D)):
            continue
        if isinstance(module, nn.Linear):
            shape, swap = (module.in_features, module.out_features), Fp8Linear.from_linear
        elif is_conv1d(module):
            shape, swap = tuple(module.weight.shape), Fp8Conv1D.from_conv1d
        else:
            continue
        reason = fp8_skip_reason(name, module, parent, embeddings, shape)
        if reason is None and policy is not None and keep_fp32_reason(policy, name, module):
            reason = f"kept in FP32 by the precision policy ({keep_fp32_reason(policy, name, module)})"
        if reason is None and module_filter_fn is not None and not module_filter_fn(module, name):
            reason = "excluded by module_filter_fn"
        layer_config = config
        if reason is None and config_fn is not None:
            layer_config = config_fn(module, name)
            if layer_config is None:
                reason = "its per-layer precision is not FP8"
        if reason is not None:
            report.skipped.append((name, reason))
            continue
        replace_module(parent, child, swap(module, layer_config, fqn=name))
        report.converted.append(name)
        report.recipes[name] = layer_config.recipe
        report.configs.setdefault(layer_config.recipe, layer_config)
    report.expected_path = _paths(model, report, config)
    return report


def _paths(model: nn.Module, report: Fp8ConversionReport, config: Fp8Config) -> str:
    """The converted layers' paths, as each layer decided them at conversion (one decider:
    :func:`mixprec.formats.fp8_path.plan_gemms`): one path, or each path with its count of layers
    when they differ. Nothing converted: the path the config would take on the model's device."""
    counts: dict[tuple[str, str], int] = {}
    for name in report.converted:
        key = (report.recipes[name], model.get_submodule(name).execution_path)
        counts[key] = counts.get(key, 0) + 1
    if not counts:
        device = next((p.device for p in model.parameters()), None)
        return plan_gemms(config, device, 16, 16).path
    if len({path for _, path in counts}) == 1:
        return next(iter(counts))[1]
    # layers differ: the count per path (and recipe, where several recipes were converted)
    several = len({recipe for recipe, _ in counts}) > 1
    return ", ".join(f"{path} ({n} {'fp8-' + recipe + ' ' if several else ''}layer{'s' if n != 1 else ''})"
                     for (recipe, path), n in counts.items())
