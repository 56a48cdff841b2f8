"""Per-step overhead of mixprec.amp.GradScaler vs torch.amp.GradScaler on the CPU.

One "step" is what a training loop pays the scaler: ``scale(loss)`` + ``unscale_(opt)`` +
``step(opt)`` + ``update()``, with an optimizer whose ``step()`` does nothing, so only the scaler
is timed. The gradients are restored between steps (outside the timed region) so repeated unscaling
never drives them into subnormals. Contenders alternate within one process; each round times a
block of steps and keeps its median; the report gives the median of rounds, the ratio and min-max.

    .venv/bin/python benchmarks/scaler_overhead.py [--rounds 7] [--sizes 100 1000 10000]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from mixprec.amp import GradScaler


class NoOpOptimizer(torch.optim.Optimizer):
    """Holds parameters like any optimizer; ``step()`` does nothing."""

    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        return None


def make_problem(n_tensors: int, numel: int):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(numel)) for _ in range(n_tensors)]
    originals = [torch.randn(numel, generator=g) * 2.0 ** 10 for _ in range(n_tensors)]
    for p, o in zip(params, originals):
        p.grad = o.clone()
    return params, [p.grad for p in params], originals


def time_block(scaler, opt, grads, originals, loss, steps: int) -> float:
    times = []
    for _ in range(steps):
        torch._foreach_copy_(grads, originals)            # not timed
        t0 = time.perf_counter()
        scaler.scale(loss)
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--numel", type=int, default=256, help="elements per gradient tensor")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loss = torch.tensor(1.0)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.numel} fp32 elements per grad")
    print(f"{'grads':>6} | {'mixprec us/step':>22} | {'torch us/step':>22} | {'ratio mixprec/torch':>26}")
    for n in args.sizes:
        params, grads, originals = make_problem(n, args.numel)
        opt = NoOpOptimizer(params)
        steps = max(10, 20000 // n)
        contenders = {
            "mixprec": GradScaler("cpu", growth_interval=10 ** 9),
            "torch": torch.amp.GradScaler("cpu", growth_interval=10 ** 9),
        }
        for s in contenders.values():                      # warm-up (kernel probe, caches)
            time_block(s, opt, grads, originals, loss, 3)
        results: dict[str, list[float]] = {k: [] for k in contenders}
        ratios = []
        for r in range(args.rounds):
            order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
            block = {}
            for name in order:
                block[name] = time_block(contenders[name], opt, grads, originals, loss, steps)
                results[name].append(block[name])
            ratios.append(block["mixprec"] / block["torch"])
        fmt = lambda v: (f"{statistics.median(v) * 1e6:8.1f} ({min(v) * 1e6:.0f}-{max(v) * 1e6:.0f})")
        print(f"{n:>6} | {fmt(results['mixprec']):>22} | {fmt(results['torch']):>22} | "
              f"{statistics.median(ratios):6.2f} ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
