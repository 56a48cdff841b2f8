"""Swap a model's Linear layers for the modules their format needs, FP8 and micro formats side by
side, and say what was left alone and why (one :class:`ConversionReport` for both).

* :func:`convert_to_fp8`: ``nn.Linear`` -> :class:`~mixprec.formats.Fp8Linear` and Hugging Face
  ``Conv1D`` (GPT-2's transposed-weight Linears) -> :class:`~mixprec.formats.Fp8Conv1D`;
* :func:`convert_to_micro`: ``nn.Linear`` -> :class:`~mixprec.formats.MicroLinear` (MXFP8,
  MXFP4, NVFP4).

Both are one walk (:func:`_walk`): each layer's format asks the one eligibility function
(:func:`mixprec.precision.eligibility.refusal`: the head, gates, modules kept FP32, shapes, the
policy's exemptions, a user's filter, a micro recipe's first/last blocks), and the path the
converted layers run is each layer's own decision (FP8: :func:`mixprec.formats.plan_gemms`; micro:
:func:`mixprec.formats.mx_linear.plan_micro_gemms`), read back for the report.
:class:`mixprec.Precision` calls these when it sets a model up; calling them directly swaps layers
without casting.
"""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from torch import nn

from mixprec.errors import ConfigError
from mixprec.formats.fp8_config import Fp8Config
from mixprec.formats.fp8_linear import Fp8Conv1D, Fp8Linear
from mixprec.formats.fp8_path import plan_gemms
from mixprec.formats.micro_config import MicroConfig
from mixprec.formats.mx_linear import MicroLinear, plan_micro_gemms
from mixprec.nn.swap import replace_module
from mixprec.policy.dtypes import dtype_name
from mixprec.policy.policy import Policy
from mixprec.precision import rules
from mixprec.precision.eligibility import model_facts, refusal, swappable

__all__ = ["ConversionReport", "convert_to_fp8", "convert_to_micro"]


@dataclass
class ConversionReport:
    """What :func:`convert_to_fp8` or :func:`convert_to_micro` did."""

    config: Fp8Config | MicroConfig | None = None
    """The conversion's base config (FP8: the ``config`` argument; micro: the first one used)."""
    converted: list[str] = field(default_factory=list)
    """Qualified names of the layers converted (``Fp8Linear``/``Fp8Conv1D``, ``MicroLinear``)."""
    recipes: dict[str, str] = field(default_factory=dict)
    """Recipe of each converted layer (differs from ``config``'s with per-layer formats)."""
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(qualified name, reason) of the modules kept out: FP8 lists Linears, embeddings and norms;
    micro the Linears asked for a micro format."""
    high_precision: str = "high precision"
    """What the skipped modules run in: the policy's compute dtype when FP8 was given a policy
    (BF16 for the ``fp8-*`` presets), "the surrounding format" for micro formats."""
    expected_path: str = "emulated"
    """Path the converted layers take, as each decided it at conversion (``execution_path``; a
    later move to another device decides again); where layers differ, the count per path
    (``emulated (4 layers), cpu-scaled-mm (2 layers)``, with the recipe where several were
    converted). The start line says ``path: ...``: it was decided, not expected."""
    configs: dict[str, Fp8Config | MicroConfig] = field(default_factory=dict)
    """The config of each recipe some layer was converted to, in first-use order."""

    @property
    def num_converted(self) -> int:
        return len(self.converted)

    @property
    def _fp8(self) -> bool:
        return isinstance(self.config, Fp8Config)

    def what_runs(self) -> str:
        """The converted layers by recipe: the one recipe's description, or, for a mix of recipes,
        each one's count and description (``4 fp8-tensorwise (...), 2 fp8-blockwise (...)``)."""
        counts: dict[str, int] = {}
        for name in self.converted:
            counts[self.recipes[name]] = counts.get(self.recipes[name], 0) + 1
        if len(counts) <= 1:
            only = self.configs.get(next(iter(counts), ""), self.config)
            return only.describe() if only is not None else "no micro format"
        return ", ".join(f"{n} {self.configs[r].describe()}" for r, n in counts.items())

    def kept_summary(self) -> str:
        """What was kept out of the format, by kind: ``1 Linear (head), 2 embeddings, 5 norms``
        (the Linears named, up to three). It said ``8 modules kept in high precision`` beside
        ``Linear layers: 8 fp8-tensorwise, 1 bf16``, which read as a contradiction (found by a
        new-user trial): the 8 were the head, the embeddings and the norms."""
        kinds: dict[str, list[str]] = {"embedding": [], "norm": [], "linear": []}
        for name, why in self.skipped:
            kind = ("embedding" if why.startswith("embedding") else
                    "norm" if why.startswith("normalization") else "linear")
            kinds[kind].append(name)
        parts = []
        if linears := kinds["linear"]:
            named = ", ".join(linears[:3]) + (", ..." if len(linears) > 3 else "")
            parts.append(f"{len(linears)} Linear{'s' if len(linears) != 1 else ''} ({named})")
        for kind in ("embedding", "norm"):
            if n := len(kinds[kind]):
                parts.append(f"{n} {kind}{'s' if n != 1 else ''}")
        return ", ".join(parts)

    def __str__(self) -> str:
        base = self.config.recipe if self.config is not None else ""
        kept = f"; kept in {self.high_precision}: {self.kept_summary()}" if self.skipped else ""
        lines = [f"{self.what_runs()}: {len(self.converted)} Linear layers converted{kept}; path: "
                 f"{self.expected_path}"]
        for name in self.converted:
            recipe = self.recipes[name]
            label = ("fp8", f" ({recipe})" if recipe != base else "") if self._fp8 else (recipe, "")
            lines.append(f"  {label[0]:<5} {name}{label[1]}")
        lines += [f"  skip  {name}: {why}" for name, why in self.skipped]
        return "\n".join(lines)


def convert_to_fp8(model: nn.Module, *, config: Fp8Config,
                   module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
                   policy: Policy | None = None,
                   config_fn: Callable[[nn.Module, str], Fp8Config | None] | None = None,
                   ) -> ConversionReport:
    """Replace eligible ``nn.Linear`` submodules of ``model`` with :class:`Fp8Linear`, in place,
    and Hugging Face ``Conv1D`` ones (GPT-2; recognised by :func:`~mixprec.formats.fp8_linear.is_conv1d`)
    with :class:`Fp8Conv1D`, which keeps the ``(in, out)`` weight layout and state-dict keys.

    ``module_filter_fn(module, qualified_name) -> bool`` is asked about every layer that passed
    the default rules; False keeps it in high precision. A ``policy`` adds its own FP32 exemptions
    (``Policy.keeps_fp32``). ``config_fn(module, qualified_name)`` (per-layer precision) gives
    each eligible Linear its own recipe, or None to keep it in high precision. Parameters are
    reused, so an optimizer built before the conversion stays valid. Returns a report of converted
    and skipped modules.
    """
    if not isinstance(config, Fp8Config):
        raise ConfigError(f"config must be an Fp8Config (e.g. Fp8Config.from_recipe('blockwise')), "
                          f"not {type(config).__name__}")
    if type(model) is nn.Linear:
        raise ConfigError("convert_to_fp8 swaps submodules in place; wrap a bare nn.Linear in a "
                          "module (e.g. nn.Sequential(linear)) or use Fp8Linear.from_linear")
    report = ConversionReport(config=config)
    if policy is not None:
        report.high_precision = f"high precision ({dtype_name(policy.compute_dtype)} compute)"

    def swap(module: nn.Module, cfg: Fp8Config, name: str) -> nn.Module:
        make = Fp8Linear.from_linear if isinstance(module, nn.Linear) else Fp8Conv1D.from_conv1d
        return make(module, cfg, fqn=name)

    _walk(model, report,
          config_for=lambda name, module: config if config_fn is None else config_fn(module, name),
          unasked="its per-layer precision is not FP8", swap=swap,
          keeps_fp32=None if policy is None else (lambda n, m: rules.keep_fp32_reason(policy, n, m)),
          module_filter_fn=module_filter_fn)
    return report


def convert_to_micro(model: nn.Module, *, config_fn: Callable[[str], MicroConfig | None],
                     keeps_fp32: Callable[[str, nn.Module], str | None] | None = None,
                     explicit: Collection[str] = (),
                     module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
                     ) -> ConversionReport:
    """Replace each ``nn.Linear`` for which ``config_fn(qualified_name)`` gives a config by a
    :class:`MicroLinear`, in place (Parameters reused). ``keeps_fp32(name, module)``: the
    policy's FP32 exemptions and why (None: not kept). ``explicit``: names whose micro format an
    override named; the NVFP4 recipe's first/last-blocks rule spares them.
    ``module_filter_fn(module, name)``: False keeps a layer out, as for :func:`convert_to_fp8`."""
    report = ConversionReport(high_precision="the surrounding format")
    _walk(model, report, config_for=lambda name, module: config_fn(name), unasked=None,
          swap=lambda module, cfg, name: MicroLinear.from_linear(module, cfg, fqn=name),
          keeps_fp32=keeps_fp32, module_filter_fn=module_filter_fn, explicit=explicit)
    report.config = next(iter(report.configs.values()), None)
    return report


_MICRO = MicroConfig.from_recipe("mxfp8")
"""Stands for the micro family where a walk has no config yet (which modules it swaps)."""


def _walk(model: nn.Module, report: ConversionReport, *,
          config_for: Callable[[str, nn.Module], Fp8Config | MicroConfig | None],
          unasked: str | None,
          swap: Callable[[nn.Module, Fp8Config | MicroConfig, str], nn.Module],
          keeps_fp32: Callable[[str, nn.Module], str | None] | None = None,
          module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
          explicit: Collection[str] = ()) -> None:
    """The one conversion walk. Each module the family swaps (:func:`swappable`) gets its config
    from ``config_for(name, module)`` and asks :func:`refusal` for it; it is swapped by
    ``swap(module, config, name)`` or reported kept out with the reason. A layer with no config
    is reported with ``unasked`` after the rules (FP8, whose base config stands in for them), or
    not at all (``unasked=None``: micro, whose layers not asked keep their format). An FP8 report
    lists the embeddings and norms too (what stays in high precision)."""
    base = report.config
    family = base or _MICRO
    facts = model_facts(model)
    for name, module in list(facts.modules.items()):
        if not name:
            continue
        if report._fp8 and (rules.is_embedding(module) or rules.is_norm(module)):
            what = "embedding" if rules.is_embedding(module) else "normalization layer"
            report.skipped.append((name, f"{what} (kept in high precision)"))
            continue
        if not swappable(module, family):
            continue
        cfg = config_for(name, module)
        if cfg is None and unasked is None:
            continue
        why = refusal(name, module, cfg or base, facts, keeps_fp32=keeps_fp32,
                      module_filter_fn=module_filter_fn, explicit=name in explicit)
        if why is None and cfg is None:
            why = unasked
        if why is not None:
            report.skipped.append((name, why))
            continue
        parent_name, _, child = name.rpartition(".")
        replace_module(facts.modules[parent_name], child, swap(module, cfg, name))
        report.converted.append(name)
        report.recipes[name] = cfg.recipe
        report.configs.setdefault(cfg.recipe, cfg)
    report.expected_path = _paths(model, report, family)


def _paths(model: nn.Module, report: ConversionReport, family: Fp8Config | MicroConfig) -> str:
    """The converted layers' paths, as each layer decided them at conversion (one decider per
    family: :func:`~mixprec.formats.plan_gemms`, :func:`~mixprec.formats.mx_linear.plan_micro_gemms`):
    one path, or each path with its count of layers when they differ. Nothing converted: the path
    the family's config would take on the model's device."""
    counts: dict[tuple[str, str], int] = {}
    for name in report.converted:
        key = (report.recipes[name], model.get_submodule(name).execution_path)
        counts[key] = counts.get(key, 0) + 1
    if not counts:
        device = next((p.device for p in model.parameters()), None)
        if isinstance(family, Fp8Config):
            return plan_gemms(family, device, 16, 16).path
        return plan_micro_gemms(family, device, 32, 32).path
    if len({path for _, path in counts}) == 1:
        return next(iter(counts))[1]
    # layers differ: the count per path (and recipe, where several recipes were converted)
    several = len({recipe for recipe, _ in counts}) > 1
    prefix = "fp8-" if isinstance(family, Fp8Config) else ""
    return ", ".join(f"{path} ({n} {prefix + recipe + ' ' if several else ''}layer{'s' if n != 1 else ''})"
                     for (recipe, path), n in counts.items())
