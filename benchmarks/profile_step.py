"""Where does a training step's time go? torch.profiler over a few ``Trainer.train_step`` calls.

    .venv/bin/python benchmarks/profile_step.py [--model small] [--precision 32-true]
        [--batch 16] [--seq 128] [--steps 3] [--warmup 2] [--threads N] [--top 15]

The step is the one ``mixprec bench train`` times (``mixprec.bench.modes.build_contender``: a
``Trainer`` with audit, progress and non-finite tracing off, stepping on one fixed batch). After
``--warmup`` untimed steps (allocator, lazy optimizer state), ``--steps`` steps are first timed
with ``perf_counter`` (no profiler: the wall time per step), then run again under
``torch.profiler`` (CPU activity, and CUDA when the model is on a GPU). The table lists the top
``--top`` operators by self CPU time, with their call counts, per step.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from mixprec.bench.modes import TrainBenchConfig, build_contender


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", help="model preset: tiny, small, gpt-ref")
    ap.add_argument("--precision", default="32-true", help="mixprec precision mode")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3, help="profiled (and, separately, timed) steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--top", type=int, default=15, help="operators listed")
    ap.add_argument("--device", default=None)
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainBenchConfig(model=args.model, modes=(args.precision,), batch=args.batch, seq=args.seq,
                           device=args.device, threads=args.threads)
    contender = build_contender(args.precision, cfg)
    assert contender is not None                      # a mixprec mode is always available
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    print(f"model {args.model}, {args.precision}, batch {args.batch} x {args.seq}, "
          f"{torch.get_num_threads()} thread(s), device {device.type}, torch {torch.__version__}")

    for _ in range(args.warmup):
        contender.step()
    _sync(device)
    walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        contender.step()
        _sync(device)
        walls.append(time.perf_counter() - t0)
    print(f"wall per step without profiler: median {statistics.median(walls) * 1e3:.1f} ms "
          f"(min {min(walls) * 1e3:.1f}, max {max(walls) * 1e3:.1f}) over {args.steps} steps")

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            contender.step()
        _sync(device)
    under = (time.perf_counter() - t0) / args.steps
    print(f"wall per step under the profiler: {under * 1e3:.1f} ms")

    events = prof.key_averages()
    total_self = sum(e.self_cpu_time_total for e in events)
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
    print(f"\ntop {len(rows)} operators by self CPU time (per step; total self CPU "
          f"{total_self / args.steps / 1e3:.1f} ms per step)")
    print(f"{'operator':<60} {'self ms/step':>12} {'share':>7} {'calls/step':>10} {'avg us/call':>11}")
    for e in rows:
        per_step = e.self_cpu_time_total / args.steps
        print(f"{e.key[:60]:<60} {per_step / 1e3:>12.2f} {e.self_cpu_time_total / total_self * 100:>6.1f}% "
              f"{e.count / args.steps:>10.1f} {e.self_cpu_time_total / max(e.count, 1):>11.1f}")


if __name__ == "__main__":
    main()
