"""Loss parity of precision modes against 32-true on the built-in corpus.

Same seed, same data order, same steps; only the policy changes. Prints a Markdown table of the
final validation loss of each mode, its difference from 32-true, and its tokens/s.

    python benchmarks/parity.py --model tiny --steps 150 \
        --modes 32-true,bf16-mixed,16-mixed,bf16-true,fp8-tensorwise,fp8-blockwise
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone

import torch

from mixprec.cli.train import build_run
from mixprec.train.config import TrainConfig
from mixprec.runs.metrics import read_metrics
from mixprec.train.trainer import Trainer


def run_mode(mode: str, args: argparse.Namespace, root: str) -> dict:
    cfg = TrainConfig(model=args.model, precision=mode, max_steps=args.steps, seq_len=args.seq,
                      batch_size=args.batch, eval_interval=0, eval_batches=args.eval_batches,
                      ckpt_interval=0, log_interval=10, lr=args.lr, warmup_steps=args.steps // 10,
                      run_dir=f"{root}/{mode}", progress=False, seed=args.seed)
    model, train_loader, val_loader, strategy = build_run(cfg)
    start = time.perf_counter()
    result = Trainer(model, config=cfg, strategy=strategy).fit(train_loader, val_loader)
    wall = time.perf_counter() - start
    rows = read_metrics(cfg.run_dir)
    tps = statistics.median(r["tokens_per_s"] for r in rows if r.get("tokens_per_s"))
    return {"mode": mode, "val_loss": result.final_val_loss, "skipped": result.skipped_steps,
            "tokens_per_s": tps, "wall_s": wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--modes", default="32-true,bf16-mixed,16-mixed,bf16-true")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-batches", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    modes = args.modes.split(",")
    results = []
    with tempfile.TemporaryDirectory() as root:
        for mode in modes:
            print(f"[parity] {mode} ...", file=sys.stderr, flush=True)
            results.append(run_mode(mode, args, root))
    ref = next((r for r in results if r["mode"] == "32-true"), results[0])
    print(f"\n{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"model {args.model}, {args.steps} steps of {args.batch}x{args.seq} tokens, seed {args.seed}\n")
    print("| mode | final val loss | vs 32-true | skipped steps | tokens/s (median) | wall s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        rel = (r["val_loss"] / ref["val_loss"] - 1.0) * 100.0
        print(f"| {r['mode']} | {r['val_loss']:.4f} | {rel:+.2f}% | {r['skipped']} | "
              f"{r['tokens_per_s']:.0f} | {r['wall_s']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
