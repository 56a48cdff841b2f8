"""``mixprec bench matmul``: GEMM throughput per dtype, measured correctly.

Seed 002 timed ``torch.matmul`` on a GPU without synchronising (so it measured kernel *launches*)
and reported ``1/t`` as "TFLOPS". Here every timing has warm-up, a device synchronisation before
the clock stops, repeats until a minimum duration, and FLOPs = 2*n^3 per n x n product.
"""
from __future__ import annotations

import argparse
import statistics

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


def bench_matmul(dtypes: list[str], sizes: list[int], *, device: str | None = None,
                 repeats: int = 3, min_time: float = 0.2) -> list[dict]:
    """Rows of {dtype, n, gflops_median, gflops_min, gflops_max, speedup_vs_fp32}.

    Dtypes are alternated inside each repeat so that machine noise hits all of them alike.
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    results: dict[tuple[str, int], list[float]] = {}
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
    for _ in range(repeats):
        for n in sizes:
            for label, dt in plan:
                if label == "fp8":
                    flops = _fp8_flops(n, dev, min_time)
                else:
                    old = torch.backends.cuda.matmul.allow_tf32
                    torch.backends.cuda.matmul.allow_tf32 = label == "tf32"
                    try:
                        flops = matmul_flops(dt, dev, n=n, min_time=min_time)
                    finally:
                        torch.backends.cuda.matmul.allow_tf32 = old
                results.setdefault((label, n), []).append(flops / 1e9)
    rows = []
    for (label, n), vals in results.items():
        base = results.get(("fp32", n))
        rows.append({"dtype": label, "n": n, "gflops_median": statistics.median(vals),
                     "gflops_min": min(vals), "gflops_max": max(vals),
                     "speedup_vs_fp32": statistics.median(vals) / statistics.median(base) if base else None})
    return rows


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtypes", default="fp32,tf32,bf16,fp16,fp8",
                        help="comma-separated: fp32, tf32 (CUDA), bf16, fp16, fp8 (CUDA FP8 GPUs)")
    parser.add_argument("--sizes", default=None, help="comma-separated n for n x n GEMMs "
                        "(default: 512,1024,2048 on CPU; 4096,8192 on CUDA)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds per measurement")
    parser.add_argument("--device", default=None)


def run(args: argparse.Namespace) -> int:
    from mixprec.errors import ConfigError
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    try:
        sizes = [int(s) for s in (args.sizes or ("4096,8192" if cuda else "512,1024,2048")).split(",")]
    except ValueError:
        raise ConfigError(f"--sizes must be comma-separated integers, got '{args.sizes}'") from None
    if args.repeats < 1 or any(n < 16 for n in sizes):
        raise ConfigError("--repeats must be >= 1 and every size >= 16")
    rows = bench_matmul(args.dtypes.split(","), sizes, device=args.device, repeats=args.repeats,
                        min_time=args.min_time)
    unit, div = ("TFLOPS", 1e3) if cuda else ("GFLOPS", 1.0)
    print(f"{'dtype':>6} {'n':>6} {unit + ' median':>14} {'min-max':>17} {'vs fp32':>8}")
    for r in sorted(rows, key=lambda r: (r["n"], r["dtype"])):
        sp = f"{r['speedup_vs_fp32']:.2f}x" if r["speedup_vs_fp32"] else "-"
        print(f"{r['dtype']:>6} {r['n']:>6} {r['gflops_median'] / div:>14.2f} "
              f"{r['gflops_min'] / div:>8.2f}-{r['gflops_max'] / div:<8.2f} {sp:>8}")
    return 0
