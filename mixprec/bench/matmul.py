"""``mixprec bench matmul``: GEMM throughput per dtype, measured correctly.

The source article on hardware cost (docs/sources.md) times ``torch.matmul`` on a GPU without
synchronising (so it measures kernel *launches*) and reports ``1/t`` as "TFLOPS". Here every
timing has warm-up, a device synchronisation before the clock stops, repeats until a minimum
duration, and FLOPs = 2*n^3 per n x n product. On a GPU the products run back to back between
two CUDA events (:func:`mixprec.policy.peak.cuda_flops`) and the probe that caps slow dtypes is a
GEMM big enough to fill the GPU: the first H200 run skipped every dtype, its 128 x 128 probe
timed kernel launches and host syncs (0.4 TFLOP/s), which put 8192 x 8192 at minutes.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from mixprec.policy.dtypes import dtype_name, parse_dtype
from mixprec.policy.hardware import cuda_supports_fp8
from mixprec.policy.peak import time_matmul

__all__ = ["bench_matmul"]


_PROBE_N = 128
"""Probe size on a CPU: an emulated FP16 GEMM of this size takes milliseconds."""

_CUDA_PROBE_N = 4096
"""Probe size on a GPU: 137 GFLOP per product, milliseconds even on a B200, no launch bound."""


def probe_size(device: torch.device, sizes: list[int]) -> int:
    """The ``n`` of the probe GEMM that estimates each dtype's time before the real sizes: small
    on a CPU (an emulated dtype must not take minutes), GPU-filling on CUDA (capped by the
    largest size asked for)."""
    if device.type == "cuda":
        return min(_CUDA_PROBE_N, max(sizes))
    return min(_PROBE_N, min(sizes))


def estimate_seconds(probe_flops: float, n: int, *, repeats: int, min_time: float) -> float:
    """Seconds ``repeats`` measurements of an ``n x n`` GEMM will take at ``probe_flops``: each
    runs 2 warm-up products, then at least 3 timed ones and at least ``min_time``."""
    t = 2.0 * n**3 / probe_flops
    return repeats * (max(min_time, 3 * t) + 2 * t)


def bench_matmul(dtypes: list[str], sizes: list[int], *, device: str | None = None,
                 repeats: int = 3, min_time: float = 0.2, max_seconds: float | None = 60.0,
                 timer: Callable[[str, torch.dtype | None, torch.device, int, float], float] = time_matmul,
                 on_size: Callable[[int, list[dict], list[str]], None] | None = None) -> list[dict]:
    """Rows of {dtype, n, gflops_median, gflops_min, gflops_max, speedup_vs_fp32}.

    Dtypes are alternated inside each repeat so that machine noise hits all of them alike; sizes
    run smallest first and ``on_size(n, rows, notes)`` is called as each size finishes. A dtype
    that runs slowly here (an FP16 GEMM *emulated* on a CPU without native FP16 math can take
    minutes per size) would stall the run, so each dtype is first timed on a probe
    (:func:`probe_size`: ``128 x 128`` on a CPU, ``4096 x 4096`` on a GPU) and a size whose
    estimated time exceeds ``max_seconds`` is skipped, with a note saying
    so (``max_seconds=None``: no cap). ``timer(label, dtype, device, n, min_time)`` returns FLOP/s
    (tests pass a fake one).
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    plan = []
    for name in dtypes:
        if name == "tf32":
            if dev.type != "cuda":
                continue
            plan.append(("tf32", torch.float32))
        elif name in ("fp8", "e4m3"):
            if not (dev.type == "cuda" and cuda_supports_fp8()):
                continue
            plan.append(("fp8", None))
        else:
            dt = parse_dtype(name)
            plan.append((dtype_name(dt), dt))
    probe: dict[str, float] = {}
    if max_seconds is not None:
        for label, dt in plan:
            probe[label] = timer(label, dt, dev, probe_size(dev, sizes), min(min_time, 0.05))
    all_rows: list[dict] = []
    for n in sorted(sizes):
        notes, todo = [], []
        for label, dt in plan:
            if label in probe:
                est = estimate_seconds(probe[label], n, repeats=repeats, min_time=min_time)
                if est > max_seconds:
                    pn = probe_size(dev, sizes)
                    notes.append(f"{label} n={n} skipped: ~{est:.0f} s estimated at "
                                 f"{probe[label] / 1e9:.2g} GFLOPS on a {pn}x{pn} probe "
                                 f"(cap {max_seconds:g} s; likely emulated on this device; raise "
                                 "--max-seconds to measure it anyway)")
                    continue
            todo.append((label, dt))
        results: dict[str, list[float]] = {}
        for _ in range(repeats):
            for label, dt in todo:
                results.setdefault(label, []).append(timer(label, dt, dev, n, min_time) / 1e9)
        rows = []
        for label, vals in results.items():
            base = results.get("fp32")
            rows.append({"dtype": label, "n": n, "gflops_median": statistics.median(vals),
                         "gflops_min": min(vals), "gflops_max": max(vals),
                         "speedup_vs_fp32": statistics.median(vals) / statistics.median(base) if base else None})
        all_rows += rows
        if on_size is not None:
            on_size(n, rows, notes)
    return all_rows
