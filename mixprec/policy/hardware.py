"""What the current hardware does well, so policies and audits can choose honestly.

Cheap checks only (no benchmarks here; measured peaks live in ``mixprec.bench``).

The CPU's flags are read once, when this module is imported, and kept in a plain module global, not
behind ``functools.cache``: the attention layer asks for them in its forward, and under
``torch.compile`` Dynamo warns about every ``lru_cache``-wrapped function it traces through
(``compile=true`` printed that warning on every run).
"""
from __future__ import annotations

import platform

import torch

__all__ = ["default_device", "cpu_has_native_bf16", "cpu_has_native_fp16", "cuda_supports_bf16",
           "cuda_supports_fp8", "bf16_is_fast"]


def default_device() -> torch.device:
    """``cuda:LOCAL_RANK``-free default: the current CUDA device if there is one, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _read_cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


_CPU_FLAGS = _read_cpu_flags()


def _cpu_flags() -> frozenset[str]:
    return _CPU_FLAGS


_NATIVE: dict[str, bool] = {}
"""``cpu_has_native_bf16`` / ``_fp16``'s answers, asked once (no ``functools.cache``: see above)."""


def cpu_has_native_bf16() -> bool:
    """True when the CPU has BF16 matrix instructions (AVX512-BF16 or AMX).

    Without them PyTorch emulates BF16 GEMMs, typically 10-100x slower than FP32 GEMMs.
    """
    if "bf16" not in _NATIVE:
        try:
            _NATIVE["bf16"] = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            _NATIVE["bf16"] = bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())
    return _NATIVE["bf16"]


def cpu_has_native_fp16() -> bool:
    """True when the CPU has FP16 matrix instructions (AVX512-FP16 or AMX-FP16)."""
    if "fp16" not in _NATIVE:
        try:
            _NATIVE["fp16"] = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            _NATIVE["fp16"] = bool({"avx512_fp16", "amx_fp16"} & _cpu_flags())
    return _NATIVE["fp16"]


_MATRIX_FLAGS = ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")


def cpu_matrix_flags() -> list[str]:
    """The 16-bit matrix instruction flags this CPU reports in /proc/cpuinfo (sorted; [] if none)."""
    return sorted(set(_MATRIX_FLAGS) & _cpu_flags())


def describe_cpu() -> str:
    """``"AMD EPYC; 16-bit matrix flags: avx512_bf16"`` for messages that advise about the CPU."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), model)
    except OSError:
        pass
    flags = ", ".join(cpu_matrix_flags()) or "none (AVX2 or older)"
    return f"{model}; 16-bit matrix flags: {flags}"


def cuda_supports_bf16() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def cuda_supports_fp8() -> bool:
    """FP8 tensor cores: compute capability 8.9 (Ada) or 9.0+ (Hopper, Blackwell)."""
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability() >= (8, 9)


def bf16_is_fast(device: torch.device | str | None = None) -> bool:
    """Whether BF16 math is native (not emulated) on ``device`` (default: the default device)."""
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return cpu_has_native_bf16()
