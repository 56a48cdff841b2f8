"""Split FP32 masters under DDP (MirroredStrategy, a real 2-process gloo job) are bit-identical to
full FP32 masters: ``bf16-true`` with clipping, accumulation under ``no_sync`` and a step that
only rank 1 sees overflow (skipped on both ranks). Tolerance 0 on parameters and masters."""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_distributed

pytestmark = pytest.mark.distributed

STEPS, ACCUM, SKIP_AT = 4, 2, 2


def _job(rank: int) -> dict:
    import mixprec as mp
    from mixprec.optim import AdamW
    from mixprec.strategies import MirroredStrategy

    strategy = MirroredStrategy()
    g = torch.Generator().manual_seed(7 + rank)
    data = [(torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g))
            for _ in range(STEPS * ACCUM)]
    out = {}
    for split in (False, True):
        torch.manual_seed(0)
        precision = mp.Precision("bf16-true")
        model = precision.setup_module(mp.models.Transformer(num_layers=1, d_model=32, num_heads=2,
                                                             max_seq_len=16))
        opt = AdamW(model.parameters(), lr=3e-3, split_masters=split)
        model, opt = strategy.setup(model, opt, precision=precision)
        skipped = []
        for step in range(STEPS):
            for micro in range(ACCUM):
                x, y = data[step * ACCUM + micro]
                ctx = strategy.no_sync(model) if micro < ACCUM - 1 else torch.enable_grad()
                with ctx, precision.autocast():
                    _, loss = model(x, y)
                    precision.backward(loss / ACCUM)
            if step == SKIP_AT and rank == 1:
                next(model.parameters()).grad[0, 0] = float("nan")     # after the all-reduce
            precision.step(opt, clip_grad_norm=0.05)
            skipped.append(precision.scaler.last_step_skipped)
            opt.zero_grad()
        out[split] = {"params": [p.detach().clone() for p in model.parameters()],
                      "masters": [m.clone() for m in opt.masters], "skipped": skipped, "split": opt.split}
    return out


def test_split_masters_under_ddp_are_bit_identical_to_fp32_masters():
    results = run_distributed(_job)
    for r in results:
        full, split = r[False], r[True]
        assert split["split"] and not full["split"]
        assert full["skipped"] == split["skipped"] == [s == SKIP_AT for s in range(STEPS)]
        for a, b in zip(full["params"], split["params"]):
            assert a.dtype == b.dtype and torch.equal(a, b)
        for a, b in zip(full["masters"], split["masters"]):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    for a, b in zip(results[0][True]["params"], results[1][True]["params"]):
        assert torch.equal(a, b)                                  # the ranks agree
