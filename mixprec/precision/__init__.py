"""The decider: :class:`Recipe` (every precision choice of a run, frozen) and :class:`Precision`
(built from one), the face through which the small plugins of :mod:`mixprec.precision.plugins`
apply it (storage dtypes, FP32 exemptions, per-layer formats, master weights, loss scaling, what
FSDP2 needs); its per-layer questions and live layer formats in one :class:`Layers`
(``precision.layers``); :func:`identity` / :func:`setup_identity` / :func:`forget_setup` (the
tag of a set-up model);
the rule book it asks (:mod:`~mixprec.precision.rules`: what kind of layer a module is); the
per-layer table it resolves a model into (:meth:`Precision.describe`); and ``autocast``.

The policy data it reads lives in :mod:`mixprec.policy`; its public names are re-exported here
(``mixprec.precision.Policy``); its modules are not (``mixprec.policy.dtypes``; the old module
paths under ``mixprec.precision`` were retired in 0.4: CHANGELOG.md). The conversions the decider
applies, to FP8 (:func:`convert_to_fp8`) and to micro formats (:func:`convert_to_micro`), live here
side by side (:mod:`~mixprec.precision.convert`, one report type), both asking the one eligibility
function (:func:`~mixprec.precision.eligibility.refusal`).
"""
from mixprec import _moved
from mixprec.policy import (ALIASES, FP8_E4M3, FP8_E5M2, FP8_RECIPES, PRESETS, FormatInfo, Policy,
                            bf16_is_fast, cpu_has_native_bf16, cuda_supports_fp8, default_device,
                            dtype_name, format_info, get_policy, parse_dtype)
from mixprec.precision import rules
from mixprec.precision.autocast import autocast
from mixprec.precision.cast import cast_module, mark_fp32_params
from mixprec.precision.convert import ConversionReport, convert_to_fp8, convert_to_micro
from mixprec.precision.eligibility import block_index, refusal
from mixprec.precision.layers import Layers
from mixprec.precision.recipe import Recipe
from mixprec.precision.precision import (OptimizerSpec, Precision, StepTaken, forget_setup, identity,
                                        prepare_fp8, setup_identity)
from mixprec.precision.rules import is_gate, is_norm, keep_fp32_reason
from mixprec.precision.table import LayerRow, LayerTable

__all__ = [
    # the decider
    "Precision", "Recipe", "Layers", "OptimizerSpec", "StepTaken", "autocast", "LayerTable", "LayerRow",
    "identity", "setup_identity", "forget_setup",
    # the rule book and applying it
    "rules", "is_norm", "is_gate", "keep_fp32_reason", "cast_module", "mark_fp32_params",
    "refusal", "convert_to_fp8", "prepare_fp8", "convert_to_micro", "ConversionReport", "block_index",
    # policy (data, from mixprec.policy)
    "Policy", "get_policy", "PRESETS", "ALIASES", "FP8_RECIPES",
    # dtype facts
    "parse_dtype", "dtype_name", "format_info", "FormatInfo", "FP8_E4M3", "FP8_E5M2",
    # hardware
    "default_device", "cpu_has_native_bf16", "bf16_is_fast", "cuda_supports_fp8",
]


def __getattr__(name: str):
    _moved.refuse(__name__, name)     # ``mixprec.precision.dtypes`` ... (moved in 0.4)
