"""What overlap_optimizer=true costs where there is no stream to overlap on (CPU).

    python benchmarks/overlap_overhead.py [--model small] [--modes 32-true,bf16-mixed]
        [--batch 16] [--seq 128] [--rounds 15] [--steps 3] [--threads 1]

On CPU the overlapped step runs the same per-module schedule in order (one partial optimizer step
per module group), so it can only cost time. For each mode the plain and the overlapped Trainer
step (``mixprec.bench.modes.build_contender``: same model, seed and batch) are timed in alternation,
the order flipping every round, and the ratio overlapped / plain is taken *per round* (so a load
change on a shared machine hits both sides of a ratio alike). Prints the median ratio and its
quartiles and min-max over the rounds, with ``uptime`` before and after. Both clocks are reported:
wall time, and the process's CPU time (``time.process_time``; with one thread it counts the work
done and not the time spent descheduled, so it is the steadier figure on a shared machine).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from mixprec.bench.modes import TrainBenchConfig, build_contender


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--modes", default="32-true,bf16-mixed")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=3, help="steps per timing sample")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"model {args.model}, batch {args.batch} x {args.seq}, {args.threads} thread(s), "
          f"torch {torch.__version__}; load average before: {_load()}")
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        cfg = TrainBenchConfig(model=args.model, modes=(mode,), batch=args.batch, seq=args.seq,
                               threads=args.threads)
        pair = [build_contender(mode, cfg), build_contender(f"{mode}+overlap", cfg)]
        for c in pair:
            for _ in range(args.warmup):
                c.step()
        clocks = {"wall": time.perf_counter, "cpu": time.process_time}
        ratios = {k: [] for k in clocks}
        times = {k: {0: [], 1: []} for k in clocks}
        for r in range(args.rounds):
            this: dict[str, dict[int, float]] = {k: {} for k in clocks}
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                w0, c0 = time.perf_counter(), time.process_time()
                for _ in range(args.steps):
                    pair[i].step()
                this["wall"][i] = (time.perf_counter() - w0) / args.steps
                this["cpu"][i] = (time.process_time() - c0) / args.steps
            for k in clocks:
                for i in (0, 1):
                    times[k][i].append(this[k][i])
                ratios[k].append(this[k][1] / this[k][0])
        for k in clocks:
            rs = ratios[k]
            q = statistics.quantiles(rs, n=4)
            print(f"{mode} [{k}]: plain {statistics.median(times[k][0]) * 1e3:.1f} ms, overlapped "
                  f"{statistics.median(times[k][1]) * 1e3:.1f} ms (medians); overlapped/plain per "
                  f"round: median {statistics.median(rs):.4f}, quartiles {q[0]:.4f}-{q[2]:.4f}, "
                  f"min-max {min(rs):.4f}-{max(rs):.4f} ({args.rounds} rounds)")
    print(f"load average after: {_load()}")


if __name__ == "__main__":
    main()
