"""overlap_optimizer=true under DDP and FSDP2, in a real 2-process gloo job.

Each rank trains the tiny Transformer 10 steps (2 micro-batches per step, its own batches) with
the plain step and with the per-module step, under DDP in 16-mixed with an inf forced into
rank 1's forward at step 5 only (the ranks must agree to skip it, and with overlap issue nothing),
and under FSDP2 in bf16-mixed (the update is per shard). Weights must be bit-identical between the
two runs on each rank, and equal across ranks.
"""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_distributed

pytestmark = pytest.mark.distributed

STEPS, ACCUM, OVERFLOW_AT = 10, 2, 5


def _run(rank: int, strategy_name: str, mode: str, overlap: bool) -> dict:
    from mixprec.models import Transformer
    from mixprec.strategies import FSDPStrategy, MirroredStrategy
    from mixprec.train.config import FitConfig
    from mixprec.train.trainer import Trainer

    torch.manual_seed(0)
    model = Transformer.from_preset("tiny", vocab_size=64, max_seq_len=16, d_model=32)
    strategy = MirroredStrategy() if strategy_name == "ddp" else FSDPStrategy()
    cfg = FitConfig(precision=mode, overlap_optimizer=overlap, grad_accum_steps=ACCUM, lr=3e-3,
                    warmup_steps=2, clip_grad_norm=1.0, log_interval=1, audit=False,
                    progress=False, trace_nonfinite=False, init_scale=2.0**8)
    trainer = Trainer(model, config=cfg, strategy=strategy)
    trainer.prepare(total_steps=STEPS)
    base = getattr(trainer.optimizer, "inner", trainer.optimizer)
    calls: list[int] = []
    base.register_step_pre_hook(lambda *_: calls.append(trainer.step))
    poison = {"on": False}
    trainer.raw_model.blocks[0].register_forward_hook(
        lambda m, a, out: (out[0] * float("inf"), *out[1:]) if poison["on"] else out)
    g = torch.Generator().manual_seed(100 + rank)
    skipped = []
    for i in range(STEPS):
        batches = [(torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g))
                   for _ in range(ACCUM)]
        poison["on"] = strategy_name == "ddp" and rank == 1 and i == OVERFLOW_AT
        skipped.append(trainer.train_step(batches).skipped)
        trainer.step += 1
    trainer.settle()
    if strategy_name == "fsdp":
        params = [p.full_tensor().detach().clone() for p in trainer.model.parameters()]
    else:
        params = [p.detach().clone() for p in trainer.raw_model.parameters()]
    from mixprec.optim import MasterWeights
    return {"params": params, "calls": calls, "skipped": skipped,
            "masked": isinstance(trainer.optimizer, MasterWeights),
            "groups": sum(1 for gr in trainer.overlap.groups if gr) if trainer.overlap else 0}


def _job(rank: int) -> dict:
    return {(s, m, o): _run(rank, s, m, o)
            for s, m in (("ddp", "16-mixed"), ("fsdp", "bf16-mixed")) for o in (False, True)}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_job, world_size=2)


@pytest.mark.parametrize("strategy,mode", [("ddp", "16-mixed"), ("fsdp", "bf16-mixed")])
def test_overlapped_step_is_bit_identical_under_data_parallelism(results, strategy, mode):
    for r in results:
        plain, over = r[(strategy, mode, False)], r[(strategy, mode, True)]
        for p, q in zip(plain["params"], over["params"]):
            assert torch.equal(p, q)
        assert plain["skipped"] == over["skipped"]
        taken = STEPS - sum(over["skipped"])
        # Without overlap a mixprec master-weight optimizer also issues a skipped step, masked on
        # the device (StepInputs.found_inf); with overlap the host decides first.
        assert len(plain["calls"]) == (STEPS if plain["masked"] else taken)
        assert len(over["calls"]) == taken * over["groups"]
    for p, q in zip(results[0][(strategy, mode, True)]["params"], results[1][(strategy, mode, True)]["params"]):
        assert torch.equal(p, q)                     # the ranks stayed together


def test_a_step_skipped_on_one_rank_is_skipped_on_both_and_issues_nothing(results):
    for r in results:
        over = r[("ddp", "16-mixed", True)]
        assert over["skipped"][OVERFLOW_AT] and sum(over["skipped"]) == 1
        assert OVERFLOW_AT not in over["calls"]
