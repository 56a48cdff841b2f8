"""Accelerators ``mixprec estimate`` knows: the datasheet table (:mod:`mixprec.policy.datasheets`,
where the figures and their sources live) and which of its peaks a precision runs at.
"""
from __future__ import annotations

from mixprec.errors import ConfigError, closest
from mixprec.policy.datasheets import GPUS, TFLOPS, GpuSpec

__all__ = ["GpuSpec", "GPUS", "TFLOPS", "get_gpu", "peak_kind", "format_peak_kind"]


def get_gpu(name: str) -> GpuSpec:
    """The table entry for ``name`` (case-insensitive), or a one-line error naming the valid ones."""
    key = str(name).strip().upper()
    if key not in GPUS:
        raise ConfigError(f"unknown GPU '{name}'{closest(key, GPUS)}; valid: {', '.join(GPUS)}, cpu "
                          "(this machine's measured peak); `mixprec estimate` also takes --peak-tflops")
    return GPUS[key]


def peak_kind(precision) -> str:
    """Which peak a :class:`mixprec.Precision`'s GEMMs run at: ``fp4`` (MXFP4 / NVFP4 Linear
    layers), ``fp8`` (FP8 or MXFP8 Linear layers),
    ``bf16`` (16-bit compute: FP16 and BF16 tensor cores have the same dense peak), ``tf32`` or
    ``fp32``."""
    fmt = precision.layers.peak_format
    return "bf16" if fmt in ("bf16", "fp16") else fmt


def format_peak_kind(fmt: str) -> str:
    """Which peak a *layer format*'s GEMMs run at: ``fp4`` (``mxfp4``, ``nvfp4``), ``fp8``
    (``fp8-*``, ``mxfp8``), ``bf16`` (``bf16``, ``fp16``) or ``fp32``."""
    if fmt in ("mxfp4", "nvfp4"):
        return "fp4"
    if fmt.startswith("fp8-") or fmt == "mxfp8":
        return "fp8"
    return "bf16" if fmt in ("bf16", "fp16") else "fp32"
