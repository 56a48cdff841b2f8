"""May this layer run in this format, and if not, why: the one answer.

:func:`refusal` answers it for a module and a format's config (an :class:`Fp8Config` or a
:class:`MicroConfig`) in one line, or None: it may. Every caller asks it and none re-derives it:

* the conversions, :func:`~mixprec.precision.convert_to_fp8` and
  :func:`~mixprec.precision.convert_to_micro` (:mod:`mixprec.precision.convert`, one walk);
* :meth:`mixprec.Precision.resolve` (``Layers.resolve``), whose per-layer table shows the answer in its ``refused``
  column before set-up as after (the audit, the planner and ``describe`` read the table);
* :func:`~mixprec.precision.layers.swap_layer` behind ``precision.layers.set_format``: the
  re-planner and the guard (:mod:`mixprec.monitor`) and ``mixprec plan``'s verification.

The rules, in the order they are asked (the first that applies is the answer):

1. the kind of module (:func:`swappable`, the isinstance rule): FP8 converts any ``nn.Linear``
   not already FP8 and Hugging Face's ``Conv1D``; micro formats a plain ``nn.Linear``;
2. the rule book's kinds (:mod:`mixprec.precision.rules`, DeepSeek-V3's recipe): the output head
   (tied to an embedding, or named ``lm_head``/``head``/``output``), a module kept FP32 by its
   ``keep_in_fp32`` tag or its parent's, an MoE gate/router;
3. the shape: in/out features multiples of 16 for FP8 GEMMs, of the block (32 for MX, 16 for
   NVFP4) for block-scaled ones (:func:`gemm_multiple`);
4. the precision policy's FP32 exemptions (``keeps_fp32``), then a user's filter
   (``module_filter_fn``);
5. a micro recipe's first/last blocks kept in the surrounding format
   (:meth:`MicroConfig.kept_blocks`, NVFP4's preset), unless an override named the format for
   this layer (``explicit``).

The facts of the model the rules need (parents, embedding weights, block indices) are gathered
once per walk by :func:`model_facts`.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import nn

from mixprec.formats.fp8_config import Fp8Config
from mixprec.formats.fp8_linear import Fp8Linear, is_conv1d
from mixprec.formats.micro_config import MicroConfig
from mixprec.precision import rules

__all__ = ["ModelFacts", "model_facts", "block_index", "swappable", "gemm_shape", "gemm_multiple",
           "refusal", "FP8_MULTIPLE"]

FP8_MULTIPLE = 16
"""FP8 GEMM kernels need in/out features that are multiples of 16 (tiny layers gain nothing)."""

FormatConfig = Fp8Config | MicroConfig


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


@dataclass(frozen=True)
class ModelFacts:
    """What :func:`refusal` needs to know about the model around a layer."""

    modules: Mapping[str, nn.Module]
    """The model's modules by qualified name (a layer's parent is looked up here)."""
    embeddings: frozenset[int]
    """``id`` of every embedding weight (a Linear sharing one is a tied head)."""
    blocks: Mapping[str, int]
    """Block index of each Linear in a block (:func:`block_index`)."""
    num_blocks: int

    def parent(self, qualified_name: str) -> nn.Module | None:
        return self.modules.get(qualified_name.rpartition(".")[0]) if qualified_name else None


def model_facts(model: nn.Module) -> ModelFacts:
    """The facts of ``model`` :func:`refusal` reads (one walk; valid while layers are swapped in
    place, since a swap keeps the parents, the Parameters and the block structure)."""
    blocks, num_blocks = block_index(model)
    return ModelFacts(modules=dict(model.named_modules()),
                      embeddings=frozenset(rules.embedding_weights(model)),
                      blocks=blocks, num_blocks=num_blocks)


def swappable(module: nn.Module, config: FormatConfig) -> bool:
    """The isinstance rule: whether a conversion to ``config``'s family swaps this kind of module.
    FP8: an ``nn.Linear`` not already FP8, or a Hugging Face ``Conv1D``; micro formats: a plain
    ``nn.Linear``."""
    if isinstance(config, Fp8Config):
        return (isinstance(module, nn.Linear) and not isinstance(module, Fp8Linear)) or is_conv1d(module)
    return type(module) is nn.Linear


def gemm_shape(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a Linear, or of a Hugging Face ``Conv1D`` (whose weight
    is stored ``(in, out)``)."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return tuple(module.weight.shape)


def gemm_multiple(config: FormatConfig) -> int:
    """What in/out features must be multiples of: 16 for FP8 GEMMs, the block (32 for MX, 16 for
    NVFP4; both multiples of 16) for block-scaled ones."""
    return FP8_MULTIPLE if isinstance(config, Fp8Config) else config.block


def refusal(qualified_name: str, module: nn.Module, config: FormatConfig, facts: ModelFacts, *,
            keeps_fp32: Callable[[str, nn.Module], str | None] | None = None,
            module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
            explicit: bool = False) -> str | None:
    """Why ``module`` (named ``qualified_name`` in the model ``facts`` describe) may not run in
    ``config``'s format, in one line; None: it may. The rules and their order: the module
    docstring. ``keeps_fp32(name, module)``: the precision policy's FP32 exemption and its reason
    (``Precision.layers.keep_fp32_reason``), None: not kept. ``module_filter_fn(module, name)``: a user's
    filter, False keeps the layer out. ``explicit``: an override named this format for this layer
    (a recipe's first/last-blocks rule spares it)."""
    if not swappable(module, config):
        return f"{type(module).__name__} is not a layer this conversion swaps"
    last = qualified_name.rpartition(".")[2]
    if id(getattr(module, "weight", None)) in facts.embeddings:
        return "output head tied to an embedding"
    if last in rules.HEAD_NAMES:
        return f"output head (named '{last}')"
    if getattr(module, "keep_in_fp32", False) or getattr(facts.parent(qualified_name), "keep_in_fp32", False):
        return "kept in FP32 (keep_in_fp32, e.g. an MoE gate)"
    if rules.is_gate(qualified_name, module):
        return f"MoE gate/router ('{last}', {type(module).__name__})"
    n_in, n_out = gemm_shape(module)
    multiple = gemm_multiple(config)
    if n_in % multiple or n_out % multiple:
        if isinstance(config, Fp8Config):
            return f"shape {n_in}->{n_out}: FP8 GEMMs need features that are multiples of {multiple}"
        return (f"shape {n_in}->{n_out}: {config.recipe} GEMMs need features that are multiples "
                f"of its {multiple}-element block")
    kept = keeps_fp32(qualified_name, module) if keeps_fp32 is not None else None
    if kept:
        return f"kept in FP32 by the precision policy ({kept})"
    if module_filter_fn is not None and not module_filter_fn(module, qualified_name):
        return "excluded by module_filter_fn"
    if isinstance(config, MicroConfig) and not explicit and qualified_name in facts.blocks:
        first, kept_last = config.kept_blocks(facts.num_blocks)
        i = facts.blocks[qualified_name]
        if i < first or i >= facts.num_blocks - kept_last:
            return (f"{config.recipe} recipe keeps the first {first} / last {kept_last} of "
                    f"{facts.num_blocks} blocks in the surrounding format (block {i})")
    return None
