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
import time
from collections.abc import Callable

import torch

from mixprec.errors import ConfigError, closest
from mixprec.policy.dtypes import dtype_name, parse_dtype
from mixprec.policy.hardware import cuda_supports_fp8
from mixprec.policy.peak import time_matmul

__all__ = ["bench_matmul", "BENCH_DTYPES", "plan_dtypes"]

BENCH_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
"""What ``bench matmul`` can time (``--help`` lists these, and so does the error for a name that is
none of them). Other spellings of fp32/bf16/fp16 (``float16``, ``half``) and ``e4m3`` for fp8 are
accepted too."""


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


def plan_dtypes(names: list[str], device: torch.device,
                fp8_here: Callable[[], bool] = cuda_supports_fp8
                ) -> tuple[list[tuple[str, torch.dtype | None]], list[tuple[str, str]]]:
    """The ``(label, dtype)`` pairs to time on ``device``, and ``(label, why)`` for each dtype
    asked for that cannot run there. A name that is no dtype here is refused (ConfigError, with the
    valid names: :data:`BENCH_DTYPES`, the list ``--help`` shows).

    It dropped tf32 and fp8 without a word on a CPU, so ``--dtypes fp8,tf32`` printed an empty
    table and exited 0 (found by a new-user trial)."""
    plan: list[tuple[str, torch.dtype | None]] = []
    cannot: list[tuple[str, str]] = []
    for raw in names:
        key = raw.strip().lower()
        if key == "tf32":
            if device.type != "cuda":
                cannot.append(("tf32", "TF32 is a CUDA tensor-core feature"))
                continue
            label, dt = "tf32", torch.float32
        elif key in ("fp8", "e4m3"):
            if device.type != "cuda":
                cannot.append(("fp8", f"no FP8 tensor cores on a {device.type.upper()} (they need a "
                                      "GPU of compute capability 8.9+)"))
                continue
            if not fp8_here():
                cannot.append(("fp8", "this GPU has no FP8 tensor cores (they need compute "
                                      "capability 8.9+)"))
                continue
            label, dt = "fp8", None
        else:
            try:
                dt = parse_dtype(key)
            except ConfigError:
                dt = None
            if dt not in (torch.float32, torch.bfloat16, torch.float16):
                raise ConfigError(f"unknown dtype '{raw}' for bench matmul{closest(key, BENCH_DTYPES)}; "
                                  f"valid: {', '.join(BENCH_DTYPES)}")
            label = dtype_name(dt)
        if all(label != done for done, _ in plan):
            plan.append((label, dt))
    return plan, cannot


def bench_matmul(dtypes: list[str], sizes: list[int], *, device: str | None = None,
                 repeats: int = 3, min_time: float = 0.2, max_seconds: float | None = 60.0,
                 timer: Callable[[str, torch.dtype | None, torch.device, int, float], float] = time_matmul,
                 on_size: Callable[[int, list[dict], list[str]], None] | None = None,
                 on_start: Callable[[int, list[str], float | None, float | None], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> list[dict]:
    """Rows of {dtype, n, gflops_median, gflops_min, gflops_max, speedup_vs_fp32}.

    Dtypes are alternated inside each repeat so that machine noise hits all of them alike; sizes
    run smallest first, ``on_start(n, labels, estimated_s, left_s)`` is called before a size
    starts (progress) and ``on_size(n, rows, notes)`` as each size finishes.

    ``max_seconds`` caps the whole run (probes included; ``None``: no cap). A dtype that runs
    slowly here (an FP16 GEMM *emulated* on a CPU without native FP16 math can take minutes per
    size) would stall the run, so each dtype is first timed on a probe (:func:`probe_size`:
    ``128 x 128`` on a CPU, ``4096 x 4096`` on a GPU) and each size's time is estimated from the
    worse of the probe's rate and the rate measured at the previous size of that dtype (emulated
    FP16 gets slower per FLOP as n grows: 2.4 GFLOP/s at 512, 0.94 at 1024 on the trial's CPU,
    so the probe alone under-estimated 2048 and the run went past 5 minutes). A (dtype, size)
    whose estimate does not fit in what is left of the budget is skipped with a one-line note.
    ``timer(label, dtype, device, n, min_time)`` returns FLOP/s and ``clock()`` seconds (tests
    pass fake ones).
    """
    t0 = clock()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    plan, _ = plan_dtypes(dtypes, dev)
    # label -> (FLOP/s, where it was measured): the worst rate seen so far for that dtype
    rate: dict[str, tuple[float, str]] = {}
    pn = probe_size(dev, sizes)
    if max_seconds is not None:
        for label, dt in plan:
            rate[label] = (timer(label, dt, dev, pn, min(min_time, 0.05)), f"the {pn}x{pn} probe")
    all_rows: list[dict] = []
    for n in sorted(sizes):
        notes, todo = [], []
        planned = 0.0
        left = None if max_seconds is None else max_seconds - (clock() - t0)
        for label, dt in plan:
            if label in rate:
                flops, where = rate[label]
                est = estimate_seconds(flops, n, repeats=repeats, min_time=min_time)
                if planned + est > left:
                    notes.append(f"{label} {n}: skipped, ~{est:.0f} s estimated at the rate measured at "
                                 f"{where} ({flops / 1e9:.3g} GFLOP/s), {max(left - planned, 0):.0f} s "
                                 f"of the {max_seconds:g} s budget left; raise --max-seconds")
                    continue
                planned += est
            todo.append((label, dt))
        if on_start is not None and todo:
            on_start(n, [label for label, _ in todo], planned if max_seconds is not None else None, left)
        results: dict[str, list[float]] = {}
        for _ in range(repeats):
            for label, dt in todo:
                results.setdefault(label, []).append(timer(label, dt, dev, n, min_time) / 1e9)
        rows = []
        for label, vals in results.items():
            base = results.get("fp32")
            if label in rate and min(vals) * 1e9 < rate[label][0]:
                rate[label] = (min(vals) * 1e9, f"n={n}")
            rows.append({"dtype": label, "n": n, "gflops_median": statistics.median(vals),
                         "gflops_min": min(vals), "gflops_max": max(vals),
                         "speedup_vs_fp32": statistics.median(vals) / statistics.median(base) if base else None})
        all_rows += rows
        if on_size is not None:
            on_size(n, rows, notes)
    return all_rows
