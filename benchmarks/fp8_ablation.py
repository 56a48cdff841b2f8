"""Where does FP8's extra loss come from? One FP8 recipe, one knob changed at a time.

Same model, seed, batches and optimizer as ``benchmarks/fp8_parity.py`` (hand-written loop, BF16
autocast around the model, FP8 GEMMs emulated inside it); each variant changes one field of the
blockwise recipe (or keeps some layers out of FP8), and ``bf16-mixed`` runs with each seed so the
seed-to-seed spread of the reference is on the same table.

    .venv/bin/python benchmarks/fp8_ablation.py --steps 300 --seeds 0,1

Prints a Markdown table: final validation loss per (variant, seed) and the mean difference from
``bf16-mixed`` over the seeds.
"""
from __future__ import annotations

import argparse
import math
import platform
import statistics
import subprocess
import time
from datetime import datetime, timezone

import torch

from mixprec.data import TokenDataset, builtin_corpus
from mixprec.formats import Fp8Config
from mixprec.precision import convert_to_fp8
from mixprec.models import Transformer
from mixprec.precision import autocast, get_policy

VARIANTS: dict[str, dict | None] = {
    "bf16-mixed": None,
    "blockwise": {},
    "blockwise/e5m2-grads": {"format": "hybrid"},
    "blockwise/fp32-wgrad": {"high_precision_wgrad": True},
    "blockwise/pow2-scales": {"power_of_two_scales": True},
    "blockwise/1x32-tiles": {"activation_block": (1, 32), "weight_block": (32, 32)},
    "blockwise/first+last-block-bf16": {"_keep": ("blocks.0.", "blocks.{last}.")},
    "tensorwise": {"_recipe": "tensorwise"},
    "tensorwise/e4m3-grads": {"_recipe": "tensorwise", "format": "e4m3"},
    "rowwise": {"_recipe": "rowwise"},
}


def batches(ds: TokenDataset, batch: int, steps: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, len(ds), (batch,), generator=g).tolist()
        xs, ys = zip(*(ds[i] for i in idx))
        out.append((torch.stack(xs), torch.stack(ys)))
    return out


def run(variant: str, seed: int, args: argparse.Namespace, train: list, val: list) -> float:
    torch.manual_seed(seed)
    model = Transformer(num_layers=args.layers, d_model=args.d_model, num_heads=args.heads,
                        vocab_size=256, max_seq_len=args.seq)
    spec = VARIANTS[variant]
    if spec is not None:
        spec = dict(spec)
        recipe = spec.pop("_recipe", "blockwise")
        keep = tuple(k.format(last=args.layers - 1) for k in spec.pop("_keep", ()))
        config = Fp8Config.from_recipe(recipe, **spec)
        convert_to_fp8(model, config=config,
                       module_filter_fn=(lambda m, n: not n.startswith(keep)) if keep else None)
    policy = get_policy("bf16-mixed")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    for x, y in train:
        with autocast(policy):
            _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()
    with torch.no_grad(), autocast(policy):
        return statistics.fmean(model(x, y)[1].item() for x, y in val)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--val-batches", type=int, default=40)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    names = [v.strip() for v in args.variants.split(",")]
    if "bf16-mixed" not in names:
        names.insert(0, "bf16-mixed")
    corpus = builtin_corpus()
    res: dict[tuple[str, int], float] = {}
    t0 = time.perf_counter()
    for seed in seeds:
        train = batches(TokenDataset(corpus.train_path, args.seq), args.batch, args.steps, seed)
        val = batches(TokenDataset(corpus.val_path, args.seq), args.batch, args.val_batches, 1000)
        for name in names:
            res[name, seed] = run(name, seed, args, train, val)
            print(f"[ablation] seed {seed} {name}: {res[name, seed]:.4f}", flush=True)
    flags = subprocess.run("grep -o 'avx512_bf16\\|amx_bf16\\|avx2' /proc/cpuinfo | sort -u | tr '\\n' ' '",
                           shell=True, capture_output=True, text=True).stdout.strip()
    print(f"\n{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, CPU flags: {flags}; "
          f"torch {torch.__version__}, {args.threads} thread(s); {args.layers} layers, d_model "
          f"{args.d_model}, {args.steps} steps of {args.batch}x{args.seq}, lr {args.lr}, seeds {seeds}, "
          f"val {args.val_batches} batches; {time.perf_counter() - t0:.0f} s\n")
    print("| variant | " + " | ".join(f"val loss seed {s}" for s in seeds) + " | mean vs bf16-mixed |")
    print("|---|" + "---|" * len(seeds) + "---|")
    for name in names:
        rel = statistics.fmean(100 * (res[name, s] / res["bf16-mixed", s] - 1) for s in seeds)
        print(f"| {name} | " + " | ".join(f"{res[name, s]:.4f}" for s in seeds) + f" | {rel:+.2f}% |")
    if len(seeds) > 1:
        spread = [res["bf16-mixed", s] for s in seeds]
        print(f"\nbf16-mixed across seeds: {min(spread):.4f}-{max(spread):.4f} "
              f"({100 * (max(spread) / min(spread) - 1):.2f}% apart; each seed also draws its own batches)")


if __name__ == "__main__":
    main()
