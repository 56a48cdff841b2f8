"""FP8 training parity on CPU: the same tiny Transformer, seed and batches under FP32, BF16-mixed
and each FP8 recipe (emulated), compared by final validation loss.

    .venv/bin/python benchmarks/fp8_parity.py --steps 300

Prints a Markdown table (and writes JSON with --json). The FP8 runs use the registered
``fp8-*`` policies: BF16 autocast around the model, FP8 (emulated) Linear GEMMs inside it, FP32
master weights. The question this answers is numerics (does FP8 training track FP32/BF16?), not
speed: on a CPU every FP8 GEMM is emulated.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

import mixprec.formats  # noqa: F401  (registers the fp8-* policies)
from mixprec.data import TokenDataset, builtin_corpus
from mixprec.precision import prepare_fp8
from mixprec.precision import autocast, get_policy

try:
    from mixprec.models import Transformer
except ImportError:  # pragma: no cover - the models room is part of the package today
    Transformer = None  # type: ignore[assignment]


def batches(ds: TokenDataset, batch: int, steps: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, len(ds), (batch,), generator=g).tolist()
        xs, ys = zip(*(ds[i] for i in idx))
        out.append((torch.stack(xs), torch.stack(ys)))
    return out


def run(mode: str, args: argparse.Namespace, train: list, val: list) -> dict:
    torch.manual_seed(args.seed)
    policy = get_policy(mode)
    if args.compute == "fp32" and policy.fp8_recipe:
        # FP8 GEMMs with FP32 everywhere else: isolates the FP8 effect, and avoids emulated BF16 on
        # CPUs without BF16 instructions (~100x slower than FP32 there).
        policy = policy.replace(name=f"{mode}/c=f32", compute_dtype=torch.float32)
    model = Transformer(num_layers=args.layers, d_model=args.d_model, num_heads=args.heads,
                        vocab_size=256, max_seq_len=args.seq)
    report = prepare_fp8(model, policy)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    t0 = time.perf_counter()
    losses = []
    for x, y in train:
        with autocast(policy):
            _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    train_s = time.perf_counter() - t0
    model.eval()
    with torch.no_grad(), autocast(policy):
        val_loss = statistics.fmean(model(x, y)[1].item() for x, y in val)
    paths = sorted({m.execution_path for m in model.modules() if hasattr(m, "execution_path")})
    return {"mode": policy.name, "final_train_loss": statistics.fmean(losses[-20:]), "val_loss": val_loss,
            "train_s": train_s, "fp8_layers": report.num_converted if report else 0,
            "paths": paths or ["-"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-batches", type=int, default=20)
    p.add_argument("--modes", default="32-true,bf16-mixed,fp8-tensorwise,fp8-delayed,fp8-rowwise,"
                   "fp8-blockwise")
    p.add_argument("--compute", choices=("policy", "fp32"), default="policy",
                   help="non-FP8 compute dtype of the fp8-* runs: the policy's (bf16) or fp32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    if Transformer is None:
        raise SystemExit("mixprec.models is not available")
    torch.set_num_threads(args.threads)  # 1 by default: far faster than 2 on a shared, busy CPU
    corpus = builtin_corpus()
    train = batches(TokenDataset(corpus.train_path, args.seq), args.batch, args.steps, args.seed)
    val = batches(TokenDataset(corpus.val_path, args.seq), args.batch, args.val_batches, args.seed + 1)
    results = []
    for mode in args.modes.split(","):
        r = run(mode.strip(), args, train, val)
        results.append(r)
        print(f"{r['mode']:>15}: val {r['val_loss']:.4f}  train {r['final_train_loss']:.4f}  "
              f"{r['train_s']:.0f}s  fp8 layers {r['fp8_layers']}  path {','.join(r['paths'])}",
              flush=True)
    refs = {r["mode"]: r["val_loss"] for r in results}
    print(f"\n{args.steps} steps, batch {args.batch} x {args.seq}, {args.layers} layers, d_model "
          f"{args.d_model}, lr {args.lr}, seed {args.seed}, val {args.val_batches} batches")
    print("\n| mode | FP8 layers | path | final val loss | vs 32-true | vs bf16-mixed | train time (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        rel = [f"{100 * (r['val_loss'] / refs[k] - 1):+.2f}%" if k in refs else "-"
               for k in ("32-true", "bf16-mixed")]
        print(f"| {r['mode']} | {r['fp8_layers']} | {','.join(r['paths'])} | {r['val_loss']:.4f} | "
              f"{rel[0]} | {rel[1]} | {r['train_s']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
