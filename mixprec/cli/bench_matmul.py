"""``mixprec bench matmul``: GEMM throughput per dtype (:mod:`mixprec.bench.matmul`)."""
from __future__ import annotations

import argparse
import sys

import torch

from mixprec.bench.matmul import BENCH_DTYPES, bench_matmul, plan_dtypes

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtypes", default=",".join(BENCH_DTYPES),
                        help="comma-separated: fp32, tf32 (CUDA only), bf16, fp16, fp8 (GPUs of compute "
                             "capability 8.9+); one that cannot run here is named with why")
    parser.add_argument("--sizes", default=None, help="comma-separated n for n x n GEMMs "
                        "(default: 512,1024,2048 on CPU; 4096,8192 on CUDA)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per (dtype, size); the median is shown")
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds per measurement")
    parser.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available, else cpu)")
    parser.add_argument("--max-seconds", type=float, default=60.0,
                        help="cap on the whole run's seconds: a (dtype, size) whose time, estimated from the worse "
                             "of a probe GEMM's rate (128x128 on CPU, 4096x4096 on CUDA) and the rate measured at the "
                             "previous size, does not fit in what is left is skipped (emulated dtypes on a CPU); 0: no cap")


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
    device = torch.device(args.device or ("cuda" if cuda else "cpu"))
    plan, cannot = plan_dtypes(args.dtypes.split(","), device)
    if not plan:        # it printed an empty table and exited 0, as if something had run
        raise ConfigError(f"nothing to measure on {device.type}: "
                          + "; ".join(f"{label}: {why}" for label, why in cannot)
                          + "; ask for fp32, bf16 or fp16")
    for label, why in cannot:
        print(f"  note: {label} not measured: {why}", flush=True)
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

    def start(n: int, labels: list[str], est: float | None, left: float | None) -> None:
        budget = "" if est is None else f" (~{est:.2g} s estimated, {left:.3g} s of the budget left)"
        print(f"  measuring n={n}: {', '.join(labels)} x {args.repeats}{budget} ...", flush=True)

    rows = bench_matmul(args.dtypes.split(","), sizes, device=args.device, repeats=args.repeats,
                        min_time=args.min_time, max_seconds=args.max_seconds or None, on_size=show,
                        on_start=start)
    if not rows:        # every (dtype, size) was over the time cap: each said so in a note
        raise ConfigError(f"nothing was measured: every size of every dtype was estimated over the "
                          f"{args.max_seconds:g} s budget (notes above); raise --max-seconds or "
                          "ask for smaller --sizes")
    return 0
