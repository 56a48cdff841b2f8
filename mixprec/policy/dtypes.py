"""Names and numeric ranges of the floating-point formats mixprec works with.

One place that knows how users spell dtypes ("bf16", "bfloat16", "float16", "half", "f32", ...)
and what each format can represent: largest finite value, smallest normal, smallest subnormal,
and mantissa bits. The monitor, the FP8 code and the policy all read these facts from here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec.errors import ConfigError, closest

__all__ = ["FormatInfo", "parse_dtype", "dtype_name", "format_info", "FP8_E4M3", "FP8_E5M2"]

FP8_E4M3: torch.dtype = torch.float8_e4m3fn
FP8_E5M2: torch.dtype = torch.float8_e5m2

_ALIASES: dict[str, torch.dtype] = {
    "f32": torch.float32, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "f16": torch.float16, "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "16": torch.float16,
    "f64": torch.float64, "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
    "e4m3": FP8_E4M3, "fp8_e4m3": FP8_E4M3, "float8_e4m3fn": FP8_E4M3,
    "e5m2": FP8_E5M2, "fp8_e5m2": FP8_E5M2, "float8_e5m2": FP8_E5M2,
}

_SHORT: dict[torch.dtype, str] = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
    FP8_E4M3: "e4m3", FP8_E5M2: "e5m2",
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Turn a user's dtype spelling (or a ``torch.dtype``) into a ``torch.dtype``."""
    if isinstance(name, torch.dtype):
        return name
    key = str(name).strip().lower().removeprefix("torch.")
    if key not in _ALIASES:
        raise ConfigError(
            f"unknown dtype '{name}'{closest(key, _ALIASES)}; valid: {', '.join(sorted(_ALIASES))}"
        )
    return _ALIASES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """Short name used in logs and tables: fp32, bf16, fp16, e4m3, e5m2."""
    return _SHORT.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class FormatInfo:
    """What a floating-point format can represent."""

    dtype: torch.dtype
    max: float
    """Largest finite value; anything larger in magnitude overflows (inf, or NaN for e4m3fn)."""
    tiny: float
    """Smallest positive normal value; below it precision is lost (subnormals)."""
    smallest_subnormal: float
    """Smallest positive representable value; below half of it values flush to zero."""
    mantissa_bits: int
    """Explicit fraction bits (the ULP at 1.0 is 2**-mantissa_bits)."""


_MANTISSA = {torch.float64: 52, torch.float32: 23, torch.bfloat16: 7, torch.float16: 10,
             FP8_E4M3: 3, FP8_E5M2: 2}


def format_info(dtype: torch.dtype | str) -> FormatInfo:
    """Range facts for a floating dtype (from ``torch.finfo``)."""
    dtype = parse_dtype(dtype)
    fi = torch.finfo(dtype)
    m = _MANTISSA.get(dtype)
    if m is None:
        raise ConfigError(f"{dtype} is not a floating-point format mixprec knows")
    return FormatInfo(dtype=dtype, max=float(fi.max), tiny=float(fi.tiny),
                      smallest_subnormal=float(fi.smallest_normal) * 2.0 ** -m, mantissa_bits=m)
