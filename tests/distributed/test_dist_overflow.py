"""An overflow on one rank skips the step on every rank (2-process gloo job, DDP).

The inf is written into rank 1's gradients *after* the DDP all-reduce, so only rank 1 sees it:
what keeps the ranks together is ``mixprec.amp.GradScaler`` all-reducing ``found_inf`` with MAX.
The same run with ``torch.amp.GradScaler`` (which decides per rank) is the control: its ranks
diverge, which shows the check below can fail.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dist_harness import run_distributed
from test_dist_mirrored import local_rows, make_data, make_model, sgd

pytestmark = pytest.mark.distributed

STEPS = 8
INJECT_AT = (2, 5)


def _run(strategy, scaler, rank: int) -> dict:
    x, y = make_data()
    model, opt = strategy.setup(make_model(), sgd)
    scales, skipped = [], []
    for step in range(STEPS):
        rows = local_rows(step, rank)
        with strategy.guard():
            scaler.scale(nn.functional.mse_loss(model(x[rows]), y[rows])).backward()
        if rank == 1 and step in INJECT_AT:
            next(model.parameters()).grad[0, 0] = float("inf")   # after the all-reduce: rank 1 only
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
        skipped.append(scaler.get_scale() < before)
    return {"params": [p.detach().clone() for p in model.parameters()], "scales": scales,
            "skipped": skipped}


def overflow_job(rank: int) -> dict:
    from mixprec.amp import GradScaler
    from mixprec.strategies import MirroredStrategy

    strategy = MirroredStrategy()
    ours = GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    out = {"mixprec": _run(strategy, ours, rank)}
    out["mixprec"]["num_skipped"] = ours.num_skipped_steps
    out["torch"] = _run(strategy, torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2), rank)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    pytest.importorskip("mixprec.amp", reason="mixprec.amp.GradScaler not built yet")
    return run_distributed(overflow_job)


def test_inf_on_one_rank_skips_the_step_on_every_rank(results):
    want = [step in INJECT_AT for step in range(STEPS)]
    for r in results:
        assert r["mixprec"]["skipped"] == want
        assert r["mixprec"]["num_skipped"] == len(INJECT_AT)


def test_loss_scale_is_identical_on_all_ranks(results):
    a, b = (r["mixprec"]["scales"] for r in results)
    assert a == b
    for step in INJECT_AT:                 # backed off at each overflow (and grew in between)
        assert a[step] == a[step - 1] / 2
    assert max(a) > 2.0 ** 8


def test_parameters_stay_identical_across_ranks(results):
    for p0, p1 in zip(results[0]["mixprec"]["params"], results[1]["mixprec"]["params"]):
        torch.testing.assert_close(p0, p1, rtol=0, atol=0)


def test_control_per_rank_decisions_diverge(results):
    """torch.amp.GradScaler decides per rank: rank 0 steps while rank 1 skips."""
    assert results[0]["torch"]["skipped"] != results[1]["torch"]["skipped"]
    assert any(not torch.equal(p0, p1) for p0, p1 in
               zip(results[0]["torch"]["params"], results[1]["torch"]["params"]))
