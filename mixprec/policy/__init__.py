"""Data: what the user asked for. The frozen :class:`Policy` and its presets, dtype and format
facts, the per-module override grammar (``pattern -> format``), hardware facts and the measured
matmul peaks. No decisions live here: :class:`mixprec.Precision` (``mixprec.precision``) makes them."""
from mixprec.policy.dtypes import FP8_E4M3, FP8_E5M2, FormatInfo, dtype_name, format_info, parse_dtype
from mixprec.policy.hardware import bf16_is_fast, cpu_has_native_bf16, cuda_supports_fp8, default_device
from mixprec.policy.exempt import is_norm
from mixprec.policy.policy import (ALIASES, FP8_RECIPES, PRESETS, Policy, cast_module, get_policy,
                                   mark_fp32_params)

__all__ = [
    # policy
    "Policy", "get_policy", "cast_module", "mark_fp32_params", "PRESETS", "ALIASES", "FP8_RECIPES", "is_norm",
    # dtype facts
    "parse_dtype", "dtype_name", "format_info", "FormatInfo", "FP8_E4M3", "FP8_E5M2",
    # hardware
    "default_device", "cpu_has_native_bf16", "bf16_is_fast", "cuda_supports_fp8",
]
