"""``mixprec bench matmul``: GEMM throughput per dtype, measured correctly.

The source article on hardware cost (docs/sources.md) times ``torch.matmul`` on a GPU without
synchronising (so it measures kernel *launches*) and reports ``1/t`` as "TFLOPS". Here every
timing has warm-up, a device synchronisation before the clock stops, repeats until a minimum
duration, and FLOPs = 2*n^3 per n x n product.
"""
from __future__ import annotations

import argparse
import sys
import statistics
from collections.abc import Callable

import torch

from mixprec.precision.dtypes import dtype_name, parse_dtype
from mixprec.precision.hardware import cuda_supports_fp8
from mixprec.precision.peak import matmul_flops

__all__ = ["bench_matmul", "configure", "run"]


def _fp8_flops(n: int, device: torch.device, min_time: float) -> float:
    """Real FP8 GEMM via ``torch._scaled_mm`` (tensorwise scales), CUDA with FP8 tensor cores."""
    import time
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major operand
    one = torch.ones((), device=device)
    mm = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
    for _ in range(3):
        mm()
    torch.cuda.synchronize(device)
    reps, start = 0, time.perf_counter()
    while True:
        mm()
        reps += 1
        torch.cuda.synchronize(device)
        if time.perf_counter() - start >= min_time and reps >= 3:
            break
    return 2.0 * n**3 * reps / (time.perf_counter() - start)


_PROBE_N = 128


def _time_matmul(label: str, dt: torch.dtype | None, dev: torch.device, n: int,
                 min_time: float) -> float:
    """FLOP/s of one ``n x n`` product in ``label``'s dtype (the real measurement)."""
    if label == "fp8":
        return _fp8_flops(n, dev, min_time)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = label == "tf32"
    try:
        return matmul_flops(dt, dev, n=n, min_time=min_time)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def estimate_seconds(probe_flops: float, n: int, *, repeats: int, min_time: float) -> float:
    """Seconds ``repeats`` measurements of an ``n x n`` GEMM will take at ``probe_flops``: each
    runs 2 warm-up products, then at least 3 timed ones and at least ``min_time``."""
    t = 2.0 * n**3 / probe_flops
    return repeats * (max(min_time, 3 * t) + 2 * t)


def bench_matmul(dtypes: list[str], sizes: list[int], *, device: str | None = None,
                 repeats: int = 3, min_time: float = 0.2, max_seconds: float | None = 60.0,
                 timer: Callable[[str, torch.dtype | None, torch.device, int, float], float] = _time_matmul,
                 on_size: Callable[[int, list[dict], list[str]], None] | None = None) -> list[dict]:
    """Rows of {dtype, n, gflops_median, gflops_min, gflops_max, speedup_vs_fp32}.

    Dtypes are alternated inside each repeat so that machine noise hits all of them alike; sizes
    run smallest first and ``on_size(n, rows, notes)`` is called as each size finishes. A dtype
    that runs slowly here (an FP16 GEMM *emulated* on a CPU without native FP16 math can take
    minutes per size) would stall the run, so each dtype is first timed on a small ``128 x 128``
    probe and a size whose estimated time exceeds ``max_seconds`` is skipped, with a note saying
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
            probe[label] = timer(label, dt, dev, min(_PROBE_N, min(sizes)), min(min_time, 0.05))
    all_rows: list[dict] = []
    for n in sorted(sizes):
        notes, todo = [], []
        for label, dt in plan:
            if label in probe:
                est = estimate_seconds(probe[label], n, repeats=repeats, min_time=min_time)
                if est > max_seconds:
                    notes.append(f"{label} n={n} skipped: ~{est:.0f} s estimated at "
                                 f"{probe[label] / 1e9:.2g} GFLOPS on a {_PROBE_N}x{_PROBE_N} probe "
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


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtypes", default="fp32,tf32,bf16,fp16,fp8",
                        help="comma-separated: fp32, tf32 (CUDA), bf16, fp16, fp8 (CUDA FP8 GPUs)")
    parser.add_argument("--sizes", default=None, help="comma-separated n for n x n GEMMs "
                        "(default: 512,1024,2048 on CPU; 4096,8192 on CUDA)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds per measurement")
    parser.add_argument("--device", default=None)
    parser.add_argument("--max-seconds", type=float, default=60.0,
                        help="skip a (dtype, size) whose time, estimated from a 128x128 probe, "
                             "exceeds this (emulated dtypes on a CPU); 0: no cap")


def run(args: argparse.Namespace) -> int:
    from mixprec.errors import ConfigError
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    try:
        sizes = [int(s) for s in (args.sizes or ("4096,8192" if cuda else "512,1024,2048")).split(",")]
    except ValueError:
        raise ConfigError(f"--sizes must be comma-separated integers, got '{args.sizes}'") from None
    if args.repeats < 1 or any(n < 16 for n in sizes):
        raise ConfigError("--repeats must be >= 1 and every size >= 16")
    if args.max_seconds < 0:
        raise ConfigError("--max-seconds must be >= 0 (0: no cap)")
    unit, div = ("TFLOPS", 1e3) if cuda else ("GFLOPS", 1.0)
    print(f"{'dtype':>6} {'n':>6} {unit + ' median':>14} {'min-max':>17} {'vs fp32':>8}", flush=True)

    def show(n: int, rows: list[dict], notes: list[str]) -> None:
        for r in sorted(rows, key=lambda r: r["dtype"]):
            sp = f"{r['speedup_vs_fp32']:.2f}x" if r["speedup_vs_fp32"] else "-"
            print(f"{r['dtype']:>6} {r['n']:>6} {r['gflops_median'] / div:>14.2f} "
                  f"{r['gflops_min'] / div:>8.2f}-{r['gflops_max'] / div:<8.2f} {sp:>8}")
        for note in notes:
            print(f"  note: {note}")
        sys.stdout.flush()   # each size as it finishes, also when piped to a file

    bench_matmul(args.dtypes.split(","), sizes, device=args.device, repeats=args.repeats,
                 min_time=args.min_time, max_seconds=args.max_seconds or None, on_size=show)
    return 0
