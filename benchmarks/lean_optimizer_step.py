"""Time of one optimizer step (no forward/backward) of mixprec's AdamW on a bf16-true model:
full FP32 masters vs split masters, BF16 / int8 / fp8 moments. Contenders alternate inside each
round; median and min-max over the rounds. Usage:
    python benchmarks/lean_optimizer_step.py --model gpt-ref --rounds 5
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import mixprec as mp
from mixprec.optim import AdamW

VARIANTS = {"full masters": dict(split_masters=False), "split masters": dict(),
            "split + bf16 moments": dict(moments="bf16"), "split + int8 moments": dict(moments="int8"),
            "split + fp8 moments": dict(moments="fp8")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt-ref")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    runs = []
    for name, kw in VARIANTS.items():
        torch.manual_seed(0)
        model = mp.Precision("bf16-true").setup_module(mp.models.Transformer.from_preset(a.model))
        opt = AdamW(model.parameters(), lr=1e-4, **kw)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()                                   # lazy state
        runs.append((name, model, opt, []))
    n = sum(p.numel() for p in runs[0][1].parameters())
    for r in range(a.rounds):
        for name, model, opt, times in (runs if r % 2 == 0 else runs[::-1]):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
    print(f"{a.model}: {n / 1e6:.2f}M parameters, {a.rounds} rounds, 1 thread")
    base = statistics.median(runs[0][3])
    for name, _, _, times in runs:
        med = statistics.median(times)
        print(f"{name:<22} {med * 1e3:8.1f} ms  (min-max {min(times) * 1e3:.1f}-{max(times) * 1e3:.1f})  {med / base:.2f}x")


if __name__ == "__main__":
    main()
