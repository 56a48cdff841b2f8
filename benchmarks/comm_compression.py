"""Gradient compression side by side: 2-process CPU (gloo) DDP step time and bytes per step.

    .venv/bin/python benchmarks/comm_compression.py [--steps 10] [--repeats 5] [--width 1024]

Both processes build one DDP model per compression (``none``, ``fp16``, ``bf16``, ``topk``) from
the same initial weights, then take turns: each repeat runs ``--steps`` training steps of every
contender, in an order rotated per repeat, with a barrier around each timed block. Rank 0 prints
the median step time, its min-max spread, the ratio to ``none``, and the payload bytes per step
each rank contributed to the gradient collectives (``Strategy.comm_stats``), plus the estimated
bytes on the wire (ring all-reduce ``2(p-1)/p x payload``, all-gather ``(p-1) x payload``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

CONTENDERS = ("none", "fp16", "bf16", "topk")


def build(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 256))


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    from mixprec.strategies import MirroredStrategy

    runs = {}
    for comp in CONTENDERS:
        strategy = MirroredStrategy(grad_compression=comp, topk_ratio=args.topk_ratio)
        model, opt = strategy.setup(build(args.width), lambda p: torch.optim.SGD(p, lr=1e-3))
        runs[comp] = (strategy, model, opt)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 256, generator=g)
    y = torch.randn(args.batch, 256, generator=g)

    def steps(comp: str, n: int) -> None:
        _, model, opt = runs[comp]
        for _ in range(n):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    for comp in CONTENDERS:   # warm-up: DDP rebuilds buckets after its first iteration
        steps(comp, 2)
    times = {c: [] for c in CONTENDERS}
    before = {c: runs[c][0].comm_stats() for c in CONTENDERS}
    for rep in range(args.repeats):
        order = CONTENDERS[rep % 4:] + CONTENDERS[:rep % 4]
        for comp in order:
            dist.barrier()
            t0 = time.perf_counter()
            steps(comp, args.steps)
            dist.barrier()
            times[comp].append((time.perf_counter() - t0) / args.steps)
    total_steps = args.repeats * args.steps
    if rank == 0:
        base = statistics.median(times["none"])
        rows = []
        for comp in CONTENDERS:
            after = runs[comp][0].comm_stats()
            per = {k: (after[k] - before[comp][k]) / total_steps
                   for k in ("bytes_sent", "bytes_dense", "wire_bytes", "values_sent", "values_dense")}
            med = statistics.median(times[comp])
            rows.append({"compression": comp, "step_ms_median": med * 1e3,
                         "step_ms_min": min(times[comp]) * 1e3, "step_ms_max": max(times[comp]) * 1e3,
                         "time_vs_none": med / base, "payload_bytes_per_step": per["bytes_sent"],
                         "dense_bytes_per_step": per["bytes_dense"], "wire_bytes_per_step": per["wire_bytes"],
                         "density": per["values_sent"] / per["values_dense"]})
        n_params = sum(p.numel() for p in runs["none"][1].parameters())
        print(f"params={n_params} width={args.width} batch/rank={args.batch} steps={args.steps} "
              f"repeats={args.repeats} threads/rank={args.threads} topk_ratio={args.topk_ratio}")
        print(f"{'compression':<12}{'step ms (median)':>17}{'min-max':>16}{'vs none':>9}"
              f"{'payload MB':>12}{'dense MB':>10}{'wire MB':>9}{'density':>9}")
        for r in rows:
            print(f"{r['compression']:<12}{r['step_ms_median']:>17.1f}"
                  f"{r['step_ms_min']:>8.1f}-{r['step_ms_max']:<7.1f}{r['time_vs_none']:>9.2f}"
                  f"{r['payload_bytes_per_step'] / 1e6:>12.2f}{r['dense_bytes_per_step'] / 1e6:>10.2f}"
                  f"{r['wire_bytes_per_step'] / 1e6:>9.2f}{r['density']:>9.3f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=5, help="timed blocks per contender")
    parser.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    parser.add_argument("--batch", type=int, default=32, help="rows per rank per step")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--topk-ratio", type=float, default=0.3)
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
