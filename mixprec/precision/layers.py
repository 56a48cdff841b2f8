"""`Layers`: every per-layer question of a run, and the live formats of the model it set up.

One per :class:`mixprec.Precision` (``precision.layers``), built from its frozen
:class:`~mixprec.precision.recipe.Recipe`. It answers what each module gets (storage dtype, FP32
exemption and why, the format a Linear asks for and the one it runs), resolves a model into the
per-layer table (:meth:`Layers.resolve`, :mod:`mixprec.precision.table`), carries the formats out
(:meth:`Layers.apply` at set-up, :meth:`Layers.set_format` for a switch while training), and holds
what that left: :attr:`~Layers.formats`, :attr:`~Layers.table` and the conversion reports. Tools
read the table and these answers; they re-derive nothing.

Module surgery, always reusing the layer's Parameters (checkpoints, FP32 masters and optimizer
state stay valid):

* FP8 formats -> :class:`mixprec.formats.Fp8Linear` (asked per module through
  ``convert_to_fp8(config_fn=...)``),
* micro formats (``mxfp8``, ``mxfp4``, ``nvfp4``) -> :class:`mixprec.formats.MicroLinear`
  (through ``convert_to_micro``),
* a 16/32-bit format other than the surrounding one -> :class:`mixprec.nn.FormatLinear`,
* the surrounding format -> a plain ``nn.Linear``.

Whether a layer may take an FP8 or micro format is the one eligibility function's answer
(:func:`mixprec.precision.eligibility.refusal`), asked by the conversions at set-up, by
:func:`swap_layer` for a later switch (re-planning, the guard) and by :meth:`Layers.resolve`: a
refused layer keeps the surrounding format.
"""
from __future__ import annotations

import torch
from torch import nn

from mixprec.errors import ConfigError
from mixprec.formats import Fp8Config, Fp8Conv1D, Fp8Linear, MicroLinear
from mixprec.nn import FormatLinear
from mixprec.nn.swap import replace_module
from mixprec.policy.dtypes import FP8_E4M3, FP8_E5M2
from mixprec.policy.overrides import is_micro, parse_format
from mixprec.precision import rules
from mixprec.precision.convert import ConversionReport, convert_to_fp8, convert_to_micro
from mixprec.precision.eligibility import ModelFacts, model_facts, refusal, swappable
from mixprec.precision.recipe import Recipe
from mixprec.precision.table import LayerRow, LayerTable

__all__ = ["Layers", "apply_formats", "swap_layer"]

_F32 = torch.float32
_LOW = (torch.bfloat16, torch.float16)
_PLAIN = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_PEAK_RANK = {"fp4": 0, "fp8": 1, "bf16": 2, "fp16": 2, "tf32": 3, "fp32": 4}
"""Matmul formats from the fastest dense peak to the slowest (FP16 and BF16 share theirs)."""


class Layers:
    """The per-layer decisions of ``recipe``, and the state of the model they were applied to."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.formats: dict[str, str] = {}
        """Each Linear's resolved compute format after :meth:`apply` (qualified name -> format)."""
        self._set_up: dict[str, str] = {}
        """:attr:`formats` as :meth:`apply` made them, before any switch while training."""
        self.table: LayerTable | None = None
        """The per-layer table of the model set up (``Precision.setup`` resolves it at the end;
        refreshed when a layer's format changes); what FSDP2's islands are read from."""
        self.fp8_report: ConversionReport | None = None
        """What the FP8 conversion of :meth:`apply` did, None when no layer asked for FP8."""
        self.micro_report: ConversionReport | None = None
        """What the micro-format conversion of :meth:`apply` did (None: no layer asked)."""

    # ------------------------------------------------------------------ one module

    def keep_fp32_reason(self, qualified_name: str, module: nn.Module) -> str | None:
        """Why ``module``'s own parameters stay FP32 (the rule book's
        :func:`~mixprec.precision.rules.keep_fp32_reason`, or a Linear whose per-layer format is
        ``fp32``), or None."""
        policy = self.recipe.policy
        why = rules.keep_fp32_reason(policy, qualified_name, module)
        if why is None and isinstance(module, nn.Linear) and policy.override_for(qualified_name) == "fp32":
            why = "per-layer format fp32"
        return why

    def keeps_fp32(self, qualified_name: str, module: nn.Module) -> bool:
        """Whether ``module``'s own parameters stay FP32 (:meth:`keep_fp32_reason`)."""
        return self.keep_fp32_reason(qualified_name, module) is not None

    def param_dtype_for(self, qualified_name: str, module: nn.Module) -> torch.dtype:
        """The dtype ``module``'s own floating parameters are stored in under this mode."""
        return _F32 if self.keeps_fp32(qualified_name, module) else self.recipe.policy.param_dtype

    def requested_format(self, qualified_name: str) -> str:
        """The format a Linear named ``qualified_name`` asks for: its first matching override,
        else the recipe's ``default_format``. FP8 is granted only where the FP8 rules allow (see
        :meth:`format_for`)."""
        return self.recipe.policy.override_for(qualified_name) or self.recipe.default_format

    def format_for(self, qualified_name: str, module: nn.Module) -> str:
        """The format ``module`` computes in: after :meth:`apply`, what the layer actually runs
        (an ``Fp8Linear``'s recipe, a ``FormatLinear``'s format, else the surrounding
        ``base_format``); for a Linear not yet set up, :meth:`requested_format`."""
        if isinstance(module, (Fp8Linear, Fp8Conv1D)):
            return f"fp8-{module.config.recipe}"
        if isinstance(module, MicroLinear):
            return module.config.recipe
        if isinstance(module, FormatLinear):
            return module.compute_format
        if isinstance(module, nn.Linear) and qualified_name not in self.formats:
            return self.requested_format(qualified_name)
        return self.recipe.base_format

    # ------------------------------------------------------------------ a whole model

    def resolve(self, model: nn.Module) -> LayerTable:
        """Every decision for ``model``, one row per parameter-owning module (before or after
        :meth:`apply`; after it, the formats the layers actually run). See :mod:`mixprec.precision.table`."""
        facts = model_facts(model)
        rows = [_row(self, name, module, facts) for name, module in facts.modules.items()
                if next(module.parameters(recurse=False), None) is not None]
        return LayerTable(self.recipe.name, tuple(rows))

    def master_params(self, model: nn.Module) -> list[torch.Tensor]:
        """The parameters the per-layer table gives FP32 masters (its ``master`` column), in
        ``model.parameters()`` order: the set ``Precision.setup`` hands ``MasterWeights``. A
        parameter shared by several modules (a tied head) gets one if any of its rows says so."""
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        wanted: set[int] = set()
        for row in self.resolve(model):
            if row.master:
                wanted.update(id(p) for p in model.get_submodule(row.name).parameters(recurse=False))
        return [p for p in model.parameters() if id(p) in wanted]

    def range_formats(self, model: nn.Module) -> dict[str, tuple[torch.dtype, torch.dtype]]:
        """Per module of the table, the formats its activations and gradients must fit, from the
        format it actually computes in: E4M3/E5M2 for an ``fp8-*`` layer, FP32/BF16/FP16 for a
        layer running in that format (a per-layer override included), else the mode's (the
        recipe's ``activation_format``, ``gradient_format``): norms (FP32 statistics, output in
        the mode's format), embeddings, block-scaled formats."""
        mode = (self.recipe.activation_format, self.recipe.gradient_format)
        out = {}
        for row in self.resolve(model):
            if row.compute.startswith("fp8-"):
                out[row.name] = (FP8_E4M3, FP8_E5M2)
            elif row.compute in _PLAIN and row.kind != "norm":
                out[row.name] = (_PLAIN[row.compute],) * 2
            else:
                out[row.name] = mode
        return out

    def apply(self, model: nn.Module) -> None:
        """Give every Linear its format (:func:`apply_formats`) and remember what runs."""
        self.formats, self.fp8_report, self.micro_report = apply_formats(self, model)
        self._set_up = dict(self.formats)

    def set_format(self, model: nn.Module, qualified_name: str, fmt: str) -> str:
        """Switch one Linear of a set-up ``model`` to ``fmt`` while training (re-planning).

        The new module shares the old one's Parameters, so parameters, FP32 masters and optimizer
        state are untouched; a delayed-scaling FP8 layer starts a fresh amax history. Storage
        dtypes do not change (a layer switched to ``fp32`` computes in FP32 from its stored
        weights). Returns the format the layer now runs in (FP8 rules may refuse FP8: then the
        surrounding format)."""
        got = swap_layer(self, model, qualified_name, fmt)
        self.formats[qualified_name] = got
        if self.table is not None:
            self.table = self.resolve(model)
        return got

    def restore(self, model: nn.Module, formats: dict[str, str]) -> None:
        """Bring a set-up ``model``'s Linears to ``formats`` (a saved :attr:`formats`)."""
        for name, fmt in formats.items():
            if name in self.formats and self.formats[name] != fmt:
                self.set_format(model, name, fmt)

    # ------------------------------------------------------------------ what runs

    def format_counts(self) -> str:
        """How many Linears run in each format after :meth:`apply` (``8 nvfp4, 1 fp32``; ``""``
        before it), largest count first."""
        counts: dict[str, int] = {}
        for f in self.formats.values():
            counts[f] = counts.get(f, 0) + 1
        return ", ".join(f"{n} {f}" for f, n in sorted(counts.items(), key=lambda c: -c[1]))

    @property
    def switched(self) -> bool:
        """Some Linear changed format while training (the guard promoted it, re-planning or a
        restored checkpoint moved it): what runs now is not what :meth:`apply` made."""
        return bool(self._set_up) and self.formats != self._set_up

    def ran(self) -> str:
        """The recipe's ``label`` with the Linear layers' formats when a plan runs (``32-true+plan
        (8 nvfp4, 1 fp32)``) or when layers switched format while training
        (``fp8-tensorwise+switched (9 bf16)``: a guarded run whose FP8 layers all went to BF16 is
        not an FP8 run): what a run's last line and record say ran."""
        counts = self.format_counts()
        label = f"{self.recipe.label}+switched" if self.switched else self.recipe.label
        return f"{label} ({counts})" if (self.recipe.has_plan or self.switched) and counts else label

    @property
    def peak_format(self) -> str:
        """The format whose dense matmul peak is the denominator of MFU, in ``fit()``'s metrics and
        in ``mixprec estimate`` alike: the recipe's ``matmul_format`` (``fp8`` for ``fp8-*``
        modes), or, after :meth:`apply`, the narrowest format a Linear layer runs in when a
        per-layer format (a plan, an override) is narrower than the mode's: a 32-true plan with
        FP8 layers is measured against the FP8 peak (and where FP8 is emulated, gets no MFU)."""
        narrowest = self.recipe.matmul_format
        for fmt in self.formats.values():
            kind = ("fp4" if fmt in ("mxfp4", "nvfp4") else "fp8" if fmt.startswith("fp8-") or fmt == "mxfp8"
                    else fmt if fmt in _PEAK_RANK else narrowest)
            if _PEAK_RANK[kind] < _PEAK_RANK.get(narrowest, len(_PEAK_RANK)):
                narrowest = kind
        return narrowest

    def describe_lines(self) -> list[str]:
        """One line per Linear: its resolved format (after :meth:`apply`)."""
        width = max((len(n) for n in self.formats), default=0)
        return [f"{n:<{width}}  {f}" for n, f in self.formats.items()]

    def describe(self, model: nn.Module | None = None) -> str:
        """With ``model``: the per-layer table of every decision for it (:meth:`resolve`), to
        print. Without: one line for logs (after :meth:`apply`, with how many Linears run in
        each format)."""
        if model is not None:
            return str(self.resolve(model))
        text = self.recipe.policy.describe()
        return text + "; Linear layers: " + self.format_counts() if self.formats else text


def _row(layers: Layers, name: str, module: nn.Module, facts: ModelFacts) -> LayerRow:
    """The table's row of one parameter-owning module (:meth:`Layers.resolve`)."""
    recipe, policy = layers.recipe, layers.recipe.policy
    own = list(module.parameters(recurse=False))
    kind = rules.layer_kind(name, module, facts.embeddings)
    keep = layers.keep_fp32_reason(name, module)
    why = [f"kept FP32: {keep}"] if keep else []
    storage = _F32 if keep else policy.param_dtype
    per_layer = rules.is_gemm_layer(module)
    refused = None
    if per_layer:
        compute = layers.format_for(name, module)
        asked = layers.requested_format(name)
        if policy.override_for(name):
            why.append(f"per-layer format {asked}")
        config = (Fp8Config.from_recipe(asked) if asked.startswith("fp8-") else
                  recipe.micro_config(asked) if is_micro(asked) else None)
        if config is not None and swappable(module, config):
            # Not (or not yet) converted: the conversion's own answer (the one function).
            refused = refusal(name, module, config, facts, keeps_fp32=layers.keep_fp32_reason,
                              explicit=policy.override_for(name) is not None)
            if refused:
                why.append(f"{asked} refused: {refused}")
            compute = recipe.base_format if refused else asked
    elif kind == "norm" and (keep or policy.is_mixed):
        compute = "fp32"            # statistics in FP32 (mixprec's norms; autocast's rule)
    elif kind == "embedding":
        compute = "-"               # a lookup, no matmul
    else:
        compute = recipe.base_format
    master = storage in _LOW and recipe.keeps_masters
    if storage in _LOW and not master:
        why.append("16-bit without FP32 masters (master_weights=False)")
    return LayerRow(name=name, type=type(module).__name__, kind=kind, params=sum(p.numel() for p in own),
                    storage=storage, compute=compute, fp32_island=keep is not None, master=master,
                    why="; ".join(why) or "the mode", per_layer=per_layer, refused=refused or "")


def apply_formats(layers: Layers, model: nn.Module
                  ) -> tuple[dict[str, str], ConversionReport | None, ConversionReport | None]:
    """Set every Linear of ``model`` up in its requested format (FP8 layers become ``Fp8Linear``,
    asked per module: the FP8 rules may keep one out, and the report says why; micro formats
    ``MicroLinear``; a format other than the surrounding one ``FormatLinear``; the rest stay).
    Returns name -> resolved format, the FP8 report and the micro report (None: none asked)."""
    recipe, policy = layers.recipe, layers.recipe.policy
    wanted = {n: layers.requested_format(n) for n, m in model.named_modules() if rules.is_gemm_layer(m)}
    fp8_report = micro_report = None
    if any(f.startswith("fp8-") for f in wanted.values()):
        configs = {f: Fp8Config.from_recipe(f) for f in set(wanted.values()) if f.startswith("fp8-")}
        fp8_report = convert_to_fp8(
            model, config=recipe.fp8 or next(iter(configs.values())), policy=policy,
            config_fn=lambda module, name: configs.get(wanted.get(name, "")))
    if any(is_micro(f) for f in wanted.values()):
        micro = {f: recipe.micro_config(f) for f in set(wanted.values()) if is_micro(f)}
        micro_report = convert_to_micro(
            model, config_fn=lambda name: micro.get(wanted.get(name, "")),
            keeps_fp32=layers.keep_fp32_reason,
            explicit={n for n in wanted if policy.override_for(n) is not None})
    modules = dict(model.named_modules())
    for name, module in list(modules.items()):
        if not isinstance(module, nn.Linear):
            continue
        fmt = wanted.get(name, recipe.base_format)
        if not fmt.startswith("fp8-") and not is_micro(fmt) and fmt != recipe.base_format \
                and type(module) is nn.Linear:
            parent, _, child = name.rpartition(".")
            replace_module(modules[parent], child, FormatLinear.from_linear(module, fmt))
    formats = {name: (recipe.base_format if type(module) is nn.Linear else layers.format_for(name, module))
               for name, module in model.named_modules() if rules.is_gemm_layer(module)}
    return formats, fp8_report, micro_report


def swap_layer(layers: Layers, model: nn.Module, qualified_name: str, fmt: str) -> str:
    """Replace the Linear ``qualified_name`` by the module ``fmt`` needs; return its format."""
    recipe = layers.recipe
    fmt = parse_format(fmt)
    parent_name, _, child = qualified_name.rpartition(".")
    parent = model.get_submodule(parent_name)
    old = getattr(parent, child)
    if not isinstance(old, nn.Linear):
        raise ConfigError(f"'{qualified_name}' is not a Linear layer ({type(old).__name__})")
    if layers.format_for(qualified_name, old) == fmt:
        return fmt
    plain = nn.Linear(old.in_features, old.out_features, bias=old.bias is not None, device="meta")
    plain.weight, plain.bias = old.weight, old.bias
    plain.train(old.training)
    new: nn.Module = plain
    config = (recipe.micro_config(fmt) if is_micro(fmt) else
              Fp8Config.from_recipe(fmt) if fmt.startswith("fp8-") else None)
    if config is not None:
        # Asked for this layer by name: a recipe's first/last-blocks rule does not apply.
        why = refusal(qualified_name, plain, config, model_facts(model),
                      keeps_fp32=layers.keep_fp32_reason, explicit=True)
        if why is None:
            make = MicroLinear.from_linear if is_micro(fmt) else Fp8Linear.from_linear
            new = make(plain, config, fqn=qualified_name)
    elif fmt != recipe.base_format:
        new = FormatLinear.from_linear(plain, fmt)
    replace_module(parent, child, new)
    return recipe.base_format if type(new) is nn.Linear else layers.format_for(qualified_name, new)
