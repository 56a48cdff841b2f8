"""A skipped step under DDP is traced on the rank that made the inf, and rank 0's log names it.

A real 2-process gloo ``fit()``: the model's forward makes an inf only on rank 1 and only for the
batch carrying a marker value; rank 0's batch is clean. Every rank skips (the scaler agrees on
``found_inf``), each replays its own batch, and ``gather_origins`` brings rank 1's origin to rank 0,
the only rank that writes ``events.jsonl``.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dist_harness import run_distributed

pytestmark = pytest.mark.distributed

MARKER = 1234.0


class RankOneOverflow(nn.Module):
    """forward(x, y) -> MSE loss; ``net.2`` outputs inf on rank 1 for a batch holding MARKER."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.net[2].register_forward_hook(self._poison)
        self.marked = False

    def _poison(self, module, args, output):
        if self.marked and torch.distributed.get_rank() == 1:   # x inf: forward and grads inf
            return output * math.inf
        return output

    def forward(self, x, y):
        self.marked = bool((x == MARKER).any())
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)


def fit_job(rank: int, run_dir: str) -> dict:
    from mixprec.strategies import MirroredStrategy
    from mixprec.train import fit
    from mixprec.runs.metrics import read_events

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, generator=g)) for _ in range(4)]
    data[3][0][0, 0] = MARKER                    # step 2, second micro-batch (grad_accum_steps=2)
    result = fit(RankOneOverflow(), data, epochs=1, strategy=MirroredStrategy(),
                 mixed_precision="32-true", grad_accum_steps=2, run_dir=run_dir, progress=False,
                 audit=False, log_interval=1, ckpt_interval=0, clip_grad_norm=None)
    return {"skipped": result.skipped_steps, "steps": result.steps,
            "events": read_events(run_dir) if rank == 0 else []}


def test_rank_zeros_events_name_the_rank_and_module_that_made_the_inf(tmp_path):
    results = run_distributed(fit_job, str(tmp_path / "run"))
    assert [r["skipped"] for r in results] == [1, 1]
    events = results[0]["events"]
    skips = [e for e in events if e["kind"] == "skip"]
    assert len(skips) == 1
    skip = skips[0]
    assert (skip["rank"], skip["module"], skip["direction"], skip["nonfinite"]) == (1, "net.2", "forward", "inf")
    assert skip["micro_batch"] == 1
    assert "inf first at net.2 (rank 1, forward, fp32)" in skip["message"]
