"""Guarded training under DDP: every rank takes the same decision, though only one rank sees the
fault.

A real 2-process gloo ``fit()`` in ``fp8-tensorwise`` with ``guard=true``. Rank 1 alone feeds
``blocks.0.proj`` inputs with two channels 10^5x the rest (FP8 flushes the others: its sampled
flushed share is far over the limit on rank 1, zero on rank 0), and rank 1 alone makes the loss of
step 7 50x larger (a spike). The ranks vote (an all-reduce MAX), so both promote the same layer at
the same step, both restore the same snapshot, and the weights stay identical across ranks.
Without the vote rank 0 would keep the layer in FP8 and restore nothing.
"""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_distributed
from guard_nets import Net, loader

pytestmark = pytest.mark.distributed

OUTLIER = "blocks.0.proj"


class RankOneFaults(Net):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        boost = torch.ones(64)
        boost[[3, 40]] = 1e5
        with torch.no_grad():
            self.blocks[0].proj.weight[:, [3, 40]] /= 1e5

        def outliers(module, args):          # carried over when the guard swaps the module
            return (args[0] * boost,) if torch.distributed.get_rank() == 1 else None
        self.blocks[0].proj.register_forward_pre_hook(outliers)

    def forward(self, idx, targets):
        loss = super().forward(idx, targets)
        if torch.is_grad_enabled():          # a training step (the guard's replays run no_grad)
            self.calls += 1
            if self.calls == 7 and torch.distributed.get_rank() == 1:
                return loss * 50
        return loss


def fit_job(rank: int, run_dir: str) -> dict:
    from mixprec.strategies import MirroredStrategy
    from mixprec.train import Trainer

    data = loader(seed=rank)
    trainer = Trainer(RankOneFaults(), strategy=MirroredStrategy(), mixed_precision="fp8-tensorwise",
                      max_steps=10, run_dir=run_dir, progress=False, audit=False, guard=True,
                      guard_every=2, guard_window=3, ckpt_interval=0, log_interval=1, lr=1e-3)
    trainer.fit(data)
    weights = {k: v.detach().clone() for k, v in trainer.strategy.unwrap(trainer.model).state_dict().items()}
    return {"actions": [(a.kind, a.step, a.switch.module if a.switch else None)
                        for a in trainer.guard.actions],
            "formats": dict(trainer.precision.layers.formats), "weights": weights}


def test_both_ranks_promote_the_same_layer_and_restore_alike_when_one_rank_sees_the_fault(tmp_path):
    r0, r1 = run_distributed(fit_job, str(tmp_path / "run"))
    assert r0["actions"] == r1["actions"]
    kinds = [(kind, step, module) for kind, step, module in r0["actions"]]
    # The first SQNR sample (step 1) fails on rank 1 only: both undo step 1 and promote the layer.
    assert kinds[:2] == [("restore", 1, None), ("promote", 1, OUTLIER)]
    assert ("restore", 7, None) in kinds                          # rank 1's spike, on both ranks
    assert r0["formats"] == r1["formats"] and r0["formats"][OUTLIER] == "bf16"
    changed = {n for n, f in r0["formats"].items() if f != "fp8-tensorwise"}
    assert OUTLIER in changed
    w0, w1 = r0["weights"], r1["weights"]
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
