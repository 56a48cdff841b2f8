"""Step-time cost of numerics monitoring on a small Transformer-like model (FP32, CPU by default).

Contenders, alternated within each repeat so machine load hits them alike:

* ``plain``        forward + backward + AdamW step, no monitoring code at all;
* ``off``          the same inside ``with monitor.sample(step)`` / ``monitor.track_updates()`` on
                   steps that are *not* sampled (what 99 of 100 steps pay with ``every=100``);
* ``sampled``      a sampled step: hooks on every Linear/LayerNorm, act + grad + update statistics,
                   one host sync; the amortised cost at ``every=100`` is ``(sampled - plain) / 100``;
* ``replay``       one :func:`mixprec.monitor.locate_nonfinite` replay of the batch (forward +
                   backward with hooks on every module), the price of diagnosing one skipped step.

Run:  .venv/bin/python benchmarks/monitor_overhead.py [--reps 7 --steps 9 --threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.monitor import NumericsMonitor, locate_nonfinite


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, d)
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)  # (B, h, T, hs)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Net(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=9, help="timed steps per contender per repeat")
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Net(256, args.d_model, args.layers, heads=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    monitor = NumericsMonitor(model, every=100, compute_dtype="fp16")
    x = torch.randint(0, 256, (args.batch, args.seq))
    y = torch.randint(0, 256, (args.batch, args.seq))

    def plain(step: int) -> None:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def monitored(step: int) -> None:
        with monitor.sample(step):
            loss = model(x, y)
            loss.backward()
            with monitor.track_updates():
                opt.step()
            opt.zero_grad(set_to_none=True)

    def replay(step: int) -> None:
        locate_nonfinite(model, lambda: (lambda l: (l.backward(), l)[1])(model(x, y)))

    contenders = {"plain": (plain, 1), "off": (monitored, 1), "sampled": (monitored, 0),
                  "replay": (replay, 1)}  # (fn, step offset: 0 -> step % 100 == 0 -> sampled)
    for fn, off in contenders.values():  # warm-up (allocator, first optimizer step, hooks)
        for s in range(3):
            fn(s * 100 + off)
    per_rep: dict[str, list[float]] = {k: [] for k in contenders}
    names = list(contenders)
    for rep in range(args.reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:  # rotate the order
            fn, off = contenders[name]
            times = []
            for s in range(args.steps):
                t0 = time.perf_counter()
                fn(s * 100 + off)
                times.append(time.perf_counter() - t0)
            per_rep[name].append(statistics.median(times))

    def q(v: list[float]) -> tuple[float, float, float]:
        v = sorted(v)
        return statistics.median(v), v[0], v[-1]

    base = statistics.median(per_rep["plain"])
    print(f"model: d={args.d_model} layers={args.layers} batch={args.batch}x{args.seq} fp32, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
          f"{len(monitor.modules)} monitored modules, threads={torch.get_num_threads()}")
    print(f"{'contender':10} {'median ms':>10} {'min-max ms':>17} {'vs plain':>9}")
    for name in names:
        med, lo, hi = q(per_rep[name])
        print(f"{name:10} {med * 1e3:10.2f} {lo * 1e3:8.2f}-{hi * 1e3:<8.2f} {med / base:8.3f}x")
    # paired per-repeat ratios are less sensitive to drifting machine load than ratios of medians
    off_r = [o / p for o, p in zip(per_rep["off"], per_rep["plain"])]
    smp_r = [s / p for s, p in zip(per_rep["sampled"], per_rep["plain"])]
    rep_r = [r / p for r, p in zip(per_rep["replay"], per_rep["plain"])]
    print(f"off / plain (paired): median {statistics.median(off_r):.3f} "
          f"(min {min(off_r):.3f}, max {max(off_r):.3f})")
    print(f"sampled / plain (paired): median {statistics.median(smp_r):.3f} "
          f"(min {min(smp_r):.3f}, max {max(smp_r):.3f}); amortised at every=100: "
          f"+{(statistics.median(smp_r) - 1) / 100:.2%} per step")
    # The off-step cost in isolation: the two context managers with no model work inside.
    n = 20_000
    t0 = time.perf_counter()
    for s in range(n):
        with monitor.sample(s * 100 + 1), monitor.track_updates():
            pass
    wrap_us = (time.perf_counter() - t0) / n * 1e6
    print(f"off-step wrapper cost alone: {wrap_us:.1f} us per step "
          f"({wrap_us / 1e6 / base:.3%} of a plain step), hooks registered: 0")
    print(f"replay / plain step (paired): median {statistics.median(rep_r):.3f} "
          f"(min {min(rep_r):.3f}, max {max(rep_r):.3f})")


if __name__ == "__main__":
    main()
