"""The decider: :class:`Precision`, the one object that turns a policy into decisions (storage
dtypes, FP32 exemptions, per-layer formats, master weights, loss scaling, what strategies need),
and ``autocast``.

The policy data it reads lives in :mod:`mixprec.policy`; its names are re-exported here so the
import paths users already have (``mixprec.precision.Policy``, ``mixprec.precision.get_policy``,
``mixprec.precision.policy``, ``mixprec.precision.dtypes``, ...) keep working.
"""
from mixprec import _compat
from mixprec.policy import dtypes, exempt, hardware, overrides, peak, policy
from mixprec.policy import (ALIASES, FP8_E4M3, FP8_E5M2, FP8_RECIPES, PRESETS, FormatInfo, Policy,
                            bf16_is_fast, cast_module, cpu_has_native_bf16, cuda_supports_fp8,
                            default_device, dtype_name, format_info, get_policy, is_norm,
                            mark_fp32_params, parse_dtype)
from mixprec.precision.autocast import autocast
from mixprec.precision.precision import OptimizerSpec, Precision

_compat.alias(__name__, dtypes=dtypes, exempt=exempt, hardware=hardware, overrides=overrides,
              peak=peak, policy=policy)

__all__ = [
    # the decider
    "Precision", "OptimizerSpec", "autocast",
    # policy (data, from mixprec.policy)
    "Policy", "get_policy", "cast_module", "mark_fp32_params", "PRESETS", "ALIASES", "FP8_RECIPES", "is_norm",
    # dtype facts
    "parse_dtype", "dtype_name", "format_info", "FormatInfo", "FP8_E4M3", "FP8_E5M2",
    # hardware
    "default_device", "cpu_has_native_bf16", "bf16_is_fast", "cuda_supports_fp8",
]
