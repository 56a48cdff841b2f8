"""Swap a model's ``nn.Linear`` layers for :class:`MicroLinear` (MXFP8, MXFP4, NVFP4), and say
what was left alone and why.

The FP8 rules decide eligibility (:func:`mixprec.precision.rules.fp8_skip_reason`: the output head,
layers tied to an embedding, MoE gates, features not multiples of 16, the policy's FP32
exemptions); MX formats also need in/out features that are multiples of their 32-element block.
Under the ``nvfp4`` preset NVIDIA's recipe keeps the first/last blocks in BF16
(:meth:`MicroConfig.kept_blocks`); a layer whose override names a micro format explicitly is
converted as asked.
"""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from torch import nn

from mixprec.formats.micro_config import MicroConfig
from mixprec.formats.mx_linear import MicroLinear
from mixprec.nn.swap import replace_module
from mixprec.precision.rules import fp8_skip_reason

__all__ = ["convert_to_micro", "MicroConversionReport", "block_index", "micro_skip_reason", "micro_refusal"]


@dataclass
class MicroConversionReport:
    """What :func:`convert_to_micro` did."""

    converted: list[str] = field(default_factory=list)
    recipes: dict[str, str] = field(default_factory=dict)
    """Recipe of each converted layer."""
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(qualified name, reason) of Linears asked for a micro format but kept out."""
    configs: dict[str, MicroConfig] = field(default_factory=dict)
    """The config of each recipe used (for the one-line description)."""
    expected_path: str = "emulated"
    """Path the converted layers take: always emulated (see mixprec.formats.mx_linear)."""

    @property
    def num_converted(self) -> int:
        return len(self.converted)

    def __str__(self) -> str:
        counts = {r: list(self.recipes.values()).count(r) for r in self.configs}
        recipes = (", ".join(f"{counts[r]} {c.describe()}" for r, c in self.configs.items())
                   if len(self.configs) > 1 else
                   ", ".join(c.describe() for c in self.configs.values()) or "no micro format")
        lines = [f"{recipes}: {len(self.converted)} Linear layers converted, {len(self.skipped)} "
                 f"kept out; path: {self.expected_path} (numerics, not speed)"]
        lines += [f"  {self.recipes[n]:<6} {n}" for n in self.converted]
        lines += [f"  skip   {n}: {why}" for n, why in self.skipped]
        return "\n".join(lines)


def block_index(model: nn.Module) -> tuple[dict[str, int], int]:
    """Which block each Linear belongs to: the index in the model's first ``nn.ModuleList`` that
    holds Linears (``blocks.3.mlp.fc`` -> 3), and the number of blocks. Linears outside it are not
    in a block. No such list: every Linear, in order, is its own block."""
    for lname, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0 and \
                any(isinstance(m, nn.Linear) for m in mod.modules()):
            prefix = f"{lname}." if lname else ""
            out = {}
            for i, child in enumerate(mod):
                for n, m in child.named_modules():
                    if isinstance(m, nn.Linear):
                        out[f"{prefix}{i}" + (f".{n}" if n else "")] = i
            return out, len(mod)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return {n: i for i, n in enumerate(names)}, len(names)


def micro_skip_reason(name: str, module: nn.Linear, parent: nn.Module | None, config: MicroConfig,
                      embedding_weights: set[int]) -> str | None:
    """Why ``module`` cannot run in ``config``'s format (None: it can)."""
    why = fp8_skip_reason(name, module, parent, embedding_weights)
    if why is not None:
        return why.replace("FP8 GEMMs", "block-scaled GEMMs")
    b = config.block
    if module.in_features % b or module.out_features % b:
        return (f"shape {module.in_features}->{module.out_features}: {config.recipe} GEMMs need "
                f"features that are multiples of its {b}-element block")
    return None


def micro_refusal(name: str, module: nn.Linear, parent: nn.Module | None, config: MicroConfig,
                  embedding_weights: set[int], blocks: tuple[dict[str, int], int], *,
                  keeps_fp32: Callable[[str, nn.Module], bool] | None = None,
                  explicit: bool = False) -> str | None:
    """Why :func:`convert_to_micro` keeps ``module`` out of ``config``'s format (None: it converts
    it): the shape and FP8 rules, the policy's FP32 exemptions, then (unless an override named the
    format, ``explicit``) the recipe's first/last blocks (``blocks``: :func:`block_index`). The
    per-layer table asks it too, so what it shows before set-up is what set-up does."""
    why = micro_skip_reason(name, module, parent, config, embedding_weights)
    if why is None and keeps_fp32 is not None and keeps_fp32(name, module):
        why = "kept in FP32 by the precision policy"
    index, num_blocks = blocks
    if why is None and not explicit and name in index:
        first, last = config.kept_blocks(num_blocks)
        i = index[name]
        if i < first or i >= num_blocks - last:
            why = (f"{config.recipe} recipe keeps the first {first} / last {last} of "
                   f"{num_blocks} blocks in the surrounding format (block {i})")
    return why


def convert_to_micro(model: nn.Module, *, config_fn: Callable[[str], MicroConfig | None],
                     keeps_fp32: Callable[[str, nn.Module], bool] | None = None,
                     explicit: Collection[str] = ()) -> MicroConversionReport:
    """Replace each ``nn.Linear`` for which ``config_fn(qualified_name)`` gives a config by a
    :class:`MicroLinear`, in place (Parameters reused). ``keeps_fp32(name, module)``: the
    policy's FP32 exemptions. ``explicit``: names whose micro format an override named; the
    NVFP4 recipe's first/last-blocks rule spares them."""
    report = MicroConversionReport()
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    blocks, num_blocks = block_index(model)
    modules = dict(model.named_modules())
    for name, module in list(modules.items()):
        if type(module) is not nn.Linear:
            continue
        config = config_fn(name)
        if config is None:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name]
        why = micro_refusal(name, module, parent, config, embeddings, (blocks, num_blocks),
                            keeps_fp32=keeps_fp32, explicit=name in explicit)
        if why is not None:
            report.skipped.append((name, why))
            continue
        replace_module(parent, child, MicroLinear.from_linear(module, config, fqn=name))
        report.converted.append(name)
        report.recipes[name] = config.recipe
        report.configs.setdefault(config.recipe, config)
    return report
