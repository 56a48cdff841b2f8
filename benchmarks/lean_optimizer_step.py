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
from mixprec.optim import split as _split
from mixprec.optim.split import _TIE, _flat_views, empty_ties  # noqa: F401  (the old split's helpers)

Tensor = torch.Tensor


@torch.no_grad()
def _split_many_before(ws: list[Tensor], his: list[Tensor], los: list[Tensor]) -> list[Tensor]:
    """:func:`split_` for a chunk (one device): round ``ws`` into ``his``, remainders into
    ``los``; returns the tie lists (one ``nonzero`` for the whole chunk)."""
    torch._foreach_copy_(his, ws)                               # round to nearest even
    flat, back = _flat_views(his, torch.float32)
    torch._foreach_copy_(back, his)
    d = [b.view(torch.int32) for b in back]
    torch._foreach_sub_(d, [w.view(torch.int32) for w in ws])   # hi - w
    torch._foreach_neg_(d)                                      # w - hi, in [-2**15, 2**15]
    flat_d = flat.view(torch.int32)
    tied = (flat_d == _TIE).nonzero().squeeze(1)
    torch._foreach_copy_(los, d)                                # wraps +2**15 to -2**15
    empty = empty_ties(flat.device)
    if not tied.numel():
        return [empty] * len(ws)
    numels = torch.tensor([w.numel() for w in ws], device=flat.device)
    starts = torch.cumsum(numels, 0) - numels
    owner = torch.bucketize(tied, starts, right=True) - 1
    counts = torch.bincount(owner, minlength=len(ws)).tolist()
    return list((tied - starts[owner]).split(counts))



_SPLIT_NOW = _split.split_many_

VARIANTS = {"full masters": dict(split_masters=False), "split masters": dict(),
            "split (before: arithmetic split)": dict(_before=True),
            "split + bf16 moments": dict(moments="bf16"), "split + int8 moments": dict(moments="int8"),
            "split + fp8 moments": dict(moments="fp8")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt-ref")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    a = ap.parse_args()
    torch.set_num_threads(1)
    runs = []
    for name in a.variants.split(","):
        kw = VARIANTS[name]
        torch.manual_seed(0)
        model = mp.Precision("bf16-true").setup_module(mp.models.Transformer.from_preset(a.model))
        kw = dict(kw)
        before = kw.pop("_before", False)
        opt = AdamW(model.parameters(), lr=1e-4, **kw)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()                                   # lazy state
        runs.append((name, model, opt, [], before))
    n = sum(p.numel() for p in runs[0][1].parameters())
    for r in range(a.rounds):
        for name, model, opt, times, before in (runs if r % 2 == 0 else runs[::-1]):
            _split.split_many_ = _split_many_before if before else _SPLIT_NOW
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
    print(f"{a.model}: {n / 1e6:.2f}M parameters, {a.rounds} rounds, 1 thread")
    base = statistics.median(runs[0][3])
    for name, _, _, times, _ in runs:
        med = statistics.median(times)
        print(f"{name:<22} {med * 1e3:8.1f} ms  (min-max {min(times) * 1e3:.1f}-{max(times) * 1e3:.1f})  {med / base:.2f}x")


if __name__ == "__main__":
    main()
