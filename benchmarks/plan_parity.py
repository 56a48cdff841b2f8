"""Final validation loss of precision modes and per-layer plans against bf16-mixed, per seed.

Each run is a separate ``mixprec train`` process (``progress=false``) with parity.py's settings
for the built-in corpus (batch 8 x 64 tokens, AdamW, peak LR 3e-3, warm-up steps // 10, final
validation over 40 batches, same seed and data order for every mode). A mode is a policy name or
``plan:PATH`` (a plan file from ``mixprec plan``). Reads the final validation loss from each run
folder's ``metrics.csv`` and the Linear formats the run used from its ``events.jsonl``, and prints
one Markdown table: per mode the share of the Linear GEMM FLOPs (``6 * in * out`` per token, as
``mixprec plan`` counts them) that ran in FP8, the same share of all the model's training FLOPs
(``Transformer.flops_per_token``, which adds the attention matmuls), and the final validation
loss per seed with its difference from ``bf16-mixed`` of the same seed.

    python benchmarks/plan_parity.py --steps 1000 --seeds 0,1,2 \
        --modes bf16-mixed,fp8-tensorwise,plan:plan.json
"""
from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from mixprec.runs.metrics import read_events, read_metrics


def settings(args: argparse.Namespace, seed: int, run_dir: str) -> list[str]:
    return [f"model={args.model}", f"max_steps={args.steps}", f"seq_len={args.seq}",
            f"batch_size={args.batch}", "eval_interval=0", f"eval_batches={args.eval_batches}",
            "ckpt_interval=0", "log_interval=10", f"lr={args.lr}", f"warmup_steps={args.steps // 10}",
            "progress=false", f"seed={seed}", f"run_dir={run_dir}"]


def linear_flops(args: argparse.Namespace) -> tuple[dict[str, int], int]:
    """Training GEMM FLOPs per token of every Linear of the model, and of the whole model."""
    from mixprec.cli.train import build_run
    from mixprec.train.config import TrainConfig
    cfg = TrainConfig(model=args.model, precision="32-true", seq_len=args.seq, batch_size=args.batch,
                      progress=False, run_dir=None)
    model, _, _, strategy = build_run(cfg)
    flops = {name: 6 * m.in_features * m.out_features for name, m in model.named_modules()
             if isinstance(m, torch.nn.Linear)}
    total = int(model.flops_per_token(args.seq)) if hasattr(model, "flops_per_token") else sum(flops.values())
    strategy.teardown()
    return flops, total


def train(mode: str, seed: int, args: argparse.Namespace, run_dir: str) -> dict:
    cmd = [sys.executable, "-m", "mixprec", "train", "--precision", mode, *settings(args, seed, run_dir)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"plan_parity: {mode} seed {seed} failed (exit {done.returncode})")
    rows = [r for r in read_metrics(run_dir) if r.get("val_loss") is not None]
    formats = next(e["layers"] for e in read_events(run_dir) if e.get("kind") == "formats")
    return {"val_loss": rows[-1]["val_loss"], "step": rows[-1]["step"], "formats": formats,
            "skipped": rows[-1].get("skipped_total", 0), "wall_s": wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="bf16-mixed,fp8-tensorwise",
                   help="comma-separated; bf16-mixed is the reference; plan:PATH for a plan file")
    p.add_argument("--seeds", default="0")
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-batches", type=int, default=40)
    args = p.parse_args()
    modes = args.modes.split(",")
    if "bf16-mixed" not in modes:
        modes.insert(0, "bf16-mixed")
    seeds = [int(s) for s in args.seeds.split(",")]
    flops, total = linear_flops(args)
    linear_total = sum(flops.values())
    res: dict[tuple[str, int], dict] = {}
    with tempfile.TemporaryDirectory() as root:
        for seed in seeds:                       # all modes of a seed back to back
            for i, mode in enumerate(modes):
                print(f"[plan_parity] seed {seed} {mode} ...", file=sys.stderr, flush=True)
                r = train(mode, seed, args, str(Path(root) / f"s{seed}-m{i}"))
                res[mode, seed] = r
                print(f"[plan_parity] seed {seed} {mode}: val {r['val_loss']:.4f} at step {r['step']} "
                      f"({r['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    print(f"\n{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, torch "
          f"{torch.__version__}; model {args.model}, {args.steps} steps of {args.batch}x{args.seq} "
          f"tokens, seeds {','.join(map(str, seeds))}\n")
    head = "| mode | FP8 share of Linear GEMM FLOPs | FP8 share of all FLOPs | " + " | ".join(
        f"val loss seed {s} (vs bf16-mixed)" for s in seeds) + " | mean difference |"
    print(head)
    print("|---" * (4 + len(seeds)) + "|")
    for mode in modes:
        fmts = res[mode, seeds[0]]["formats"]
        fp8 = sum(f for name, f in flops.items() if fmts.get(name, "").startswith("fp8-"))
        cells, diffs = [], []
        for s in seeds:
            v, ref = res[mode, s]["val_loss"], res["bf16-mixed", s]["val_loss"]
            diffs.append((v / ref - 1.0) * 100.0)
            cells.append(f"{v:.4f} ({diffs[-1]:+.2f}%)")
        print(f"| {mode} | {100 * fp8 / linear_total:.1f}% | {100 * fp8 / total:.1f}% | " + " | ".join(cells)
              + f" | {statistics.mean(diffs):+.2f}% |")
    for mode in modes:
        fmts = res[mode, seeds[0]]["formats"]
        print(f"\n{mode}: " + ", ".join(f"{n}={f}" for n, f in fmts.items()), end="")
        if any(res[mode, s]["skipped"] for s in seeds):
            print(f" (skipped steps: {[res[mode, s]['skipped'] for s in seeds]})", end="")
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
