"""BF16 Adam moments vs FP32 moments: effect on training, and optimizer step time.

Run:  .venv/bin/python benchmarks/optim_bf16_moments.py [--repeats 5] [--threads 1]

Part 1 (quality): a noisy linear regression (256 x 64 -> 8) and a small MLP on a synthetic
two-moons-like task, trained with AdamW for the same steps with FP32 moments, BF16 moments with
stochastic rounding, and BF16 moments with round-to-nearest. Reports final loss per seed.
Part 2 (decay): exp_avg_sq after the gradients shrink 100x (the case nearest rounding gets wrong).
Part 3 (speed): optimizer step time for ~1M params, contenders alternated in one process.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from mixprec.optim import AdamW

VARIANTS = {
    "fp32-moments": {"moments_dtype": torch.float32},
    "bf16-stochastic": {"moments_dtype": torch.bfloat16, "stochastic_rounding": True},
    "bf16-nearest": {"moments_dtype": torch.bfloat16, "stochastic_rounding": False},
}


def regression_loss(variant: dict, seed: int, steps: int = 400) -> float:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 64, generator=gen)
    y = x @ torch.randn(64, 8, generator=gen) + 0.1 * torch.randn(256, 8, generator=gen)
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 8)
    opt = AdamW(model.parameters(), lr=3e-3, seed=seed, **variant)
    for _ in range(steps):
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()
    return (model(x) - y).pow(2).mean().item()


def mlp_loss(variant: dict, seed: int, steps: int = 400) -> float:
    gen = torch.Generator().manual_seed(seed)
    t = torch.rand(512, generator=gen) * 3.14159
    label = torch.randint(0, 2, (512,), generator=gen)
    x = torch.stack([torch.cos(t) + label, torch.sin(t) * (1 - 2 * label)], 1) + 0.1 * torch.randn(512, 2, generator=gen)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                torch.nn.GELU(), torch.nn.Linear(64, 2))
    opt = AdamW(model.parameters(), lr=3e-3, seed=seed, **variant)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), label).backward()
        opt.step()
    return torch.nn.functional.cross_entropy(model(x), label).item()


def decay(variant: dict) -> float:
    p = torch.nn.Parameter(torch.zeros(4096))
    opt = AdamW([p], lr=0.0, weight_decay=0.0, seed=0, **variant)
    for step in range(1020):
        p.grad = torch.full_like(p, 1.0 if step < 20 else 0.01)
        opt.step()
    return opt.state[p]["exp_avg_sq"].float().mean().item()


def step_times(repeats: int, steps: int = 20) -> dict[str, list[float]]:
    shapes = [(1024, 512)] * 2 + [(512,)] * 4  # ~1.05 M params in 6 tensors
    contenders = {}
    for name, kwargs in [("torch.optim.AdamW fp32 params (foreach)", None),
                         ("mixprec AdamW fp16 params + masters, fp32 moments", {"fp16_params": True}),
                         ("mixprec AdamW fp16 params + masters, bf16 moments SR",
                          {"fp16_params": True, "moments_dtype": torch.bfloat16}),
                         ("mixprec AdamW fp16 params + masters, bf16 moments nearest",
                          {"fp16_params": True, "moments_dtype": torch.bfloat16, "stochastic_rounding": False})]:
        params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        opt = torch.optim.AdamW(params, foreach=True) if kwargs is None else AdamW(params, **kwargs)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()  # warm-up: state allocation
        contenders[name] = opt
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, opt in contenders.items():  # alternate contenders within each repeat
            t0 = time.perf_counter()
            for _ in range(steps):
                opt.step()
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    return times


def _fmt(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.4g} (min {min(xs):.4g}, max {max(xs):.4g})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} intra-op thread(s)")
    for task, fn in (("regression MSE", regression_loss), ("MLP cross-entropy", mlp_loss)):
        print(f"\n{task} after 400 AdamW steps, seeds 0..{args.repeats - 1}:")
        ref = [fn(VARIANTS["fp32-moments"], s) for s in range(args.repeats)]
        print(f"  {'fp32-moments':16s} {_fmt(ref)}")
        for name in ("bf16-stochastic", "bf16-nearest"):
            losses = [fn(VARIANTS[name], s) for s in range(args.repeats)]
            rel = [(a - b) / b for a, b in zip(losses, ref)]
            print(f"  {name:16s} {_fmt(losses)}; relative to fp32 per seed: {_fmt(rel)}")
    print("\nexp_avg_sq mean after 20 steps of |g|=1 then 1000 of |g|=0.01 (beta2=0.999):")
    for name, variant in VARIANTS.items():
        print(f"  {name:16s} {decay(variant):.6g}")
    print(f"\noptimizer step time, ~1.05M params, ms per step ({args.repeats} repeats x 20 steps):")
    times = step_times(args.repeats)
    base = statistics.median(next(iter(times.values())))
    for name, ts in times.items():
        print(f"  {name:58s} {_fmt(ts)}  ratio {statistics.median(ts) / base:.2f}")


if __name__ == "__main__":
    main()
