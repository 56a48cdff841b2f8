"""MirroredStrategy (DDP) in a real 2-process gloo job, checked against one-process FP32 references.

One job runs every scenario (spawning processes costs more than the training here); each test
below asserts on one part of its results. The overflow scenario writes an inf into rank 1's
gradients *after* the DDP all-reduce, so only rank 1 sees it: what keeps the ranks together is
``mixprec.amp.GradScaler`` all-reducing ``found_inf`` with MAX. The same run with
``torch.amp.GradScaler`` (which decides per rank) is the control: its ranks diverge.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dist_harness import run_distributed

pytestmark = pytest.mark.distributed

WORLD = 2
LOCAL_B = 8            # rows per rank per step
STEPS = 5
LR = 0.05


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def make_data(n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 4, generator=g)) @ torch.randn(4, 1, generator=g)
    return x, y + 0.05 * torch.randn(n, 1, generator=g)


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


def local_rows(step: int, rank: int, per_rank: int = LOCAL_B) -> slice:
    start = step * per_rank * WORLD + rank * per_rank
    return slice(start, start + per_rank)


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _train(strategy, model, opt, x, y, rank, steps, *, accum=1, use_no_sync=True):
    mse = nn.functional.mse_loss
    per = LOCAL_B // accum
    for step in range(steps):
        for micro in range(accum):
            rows = local_rows(step * accum + micro, rank, per)
            ctx = strategy.no_sync(model) if use_no_sync and micro < accum - 1 else _null()
            with ctx:
                (mse(model(x[rows]), y[rows]) / accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def full_loss(model, x, y) -> float:
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), y).item()


OVF_STEPS = 8
INJECT_AT = (2, 5)


def _overflow_run(strategy, scaler, rank: int) -> dict:
    x, y = make_data()
    model, opt = strategy.setup(make_model(), sgd)
    scales, skipped = [], []
    for step in range(OVF_STEPS):
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


def mirrored_job(rank: int) -> dict:
    from mixprec.strategies import MirroredStrategy, current_strategy

    out: dict = {}
    x, y = make_data()
    strategy = MirroredStrategy()
    with strategy.scope():
        out["scope_current"] = current_strategy() is strategy
    out["mean"] = strategy.reduce_mean(rank + 1.0)
    out["max"] = strategy.reduce_max(torch.tensor(rank + 1.0))

    # 1) plain DDP on the same global batch as the one-process reference
    model, opt = strategy.setup(make_model(), sgd)
    _train(strategy, model, opt, x, y, rank, STEPS)
    out["ddp"] = params_of(model)
    out["ddp_collectives"] = strategy.hook_states[-1].counter.collectives

    # 2) accumulation: 4 micro-steps, no_sync on the first 3, vs syncing every micro-step
    for name, use in (("accum_nosync", True), ("accum_sync", False)):
        model, opt = strategy.setup(make_model(), sgd)
        _train(strategy, model, opt, x, y, rank, 3, accum=4, use_no_sync=use)
        out[name] = params_of(model)
        out[name + "_collectives"] = strategy.hook_states[-1].counter.collectives

    # 3) compressed all-reduce: byte counts, and every rank ends with identical parameters
    for comp in ("fp16", "bf16", "topk"):
        s = MirroredStrategy(grad_compression=comp, topk_ratio=0.3)
        model, opt = s.setup(make_model(), sgd)
        _train(s, model, opt, x, y, rank, STEPS)
        out[comp] = {"stats": s.comm_stats(), "params": params_of(model)}

    # 4) top-k with error feedback vs dense, many steps on a small regression problem
    for comp in ("none", "topk"):
        s = MirroredStrategy(grad_compression=comp, topk_ratio=0.3)
        model, opt = s.setup(make_model(), lambda p: torch.optim.SGD(p, lr=0.1))
        for epoch in range(15):
            _train(s, model, opt, x, y, rank, len(x) // (LOCAL_B * WORLD))
        out["conv_" + comp] = {"loss": full_loss(s.unwrap(model), x, y), "stats": s.comm_stats()}
        if comp == "topk":
            sd = s.comm_state_dict()
            out["topk_state_rank0"] = sd if rank == 0 else None
            fresh = MirroredStrategy(grad_compression="topk")
            fresh.setup(make_model(), sgd)
            fresh.load_comm_state_dict(sd if rank == 0 else None)  # rank 1 receives rank 0's copy
            mine = s.hook_states[0].state_dict()["residuals"]
            got = fresh.hook_states[0].state_dict()["residuals"]
            out["topk_state_roundtrip"] = all(torch.equal(mine[k], got[k]) for k in mine) and \
                mine.keys() == got.keys()

    # 5) checkpoint load where only rank 0 read the file
    model, opt = strategy.setup(make_model(), sgd)
    target = {k: torch.full_like(v, 0.5) for k, v in strategy.unwrap(model).state_dict().items()}
    strategy.load_model_state_dict(model, target if rank == 0 else None)
    out["loaded"] = all(torch.equal(v, target[k]) for k, v in strategy.model_state_dict(model).items())

    # 6) overflow on rank 1 only, injected after the all-reduce: mixprec's scaler agrees across
    #    ranks (found_inf MAX); torch.amp.GradScaler decides per rank (the control that diverges)
    from mixprec.amp import GradScaler
    ours = GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    out["overflow"] = _overflow_run(strategy, ours, rank)
    out["overflow"]["num_skipped"] = ours.num_skipped_steps
    out["overflow_torch"] = _overflow_run(strategy, torch.amp.GradScaler("cpu", init_scale=2.0 ** 8,
                                                                         growth_interval=2), rank)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(mirrored_job, world_size=WORLD)


def reference(steps: int, *, accum: int = 1) -> list[torch.Tensor]:
    """One process, FP32, the whole global batch (WORLD x LOCAL_B rows) per step."""
    x, y = make_data()
    model = make_model()
    opt = sgd(model.parameters())
    per = LOCAL_B // accum
    for step in range(steps):
        for micro in range(accum):
            base = (step * accum + micro) * per * WORLD
            rows = slice(base, base + per * WORLD)
            (nn.functional.mse_loss(model(x[rows]), y[rows]) / accum).backward()
        opt.step()
        opt.zero_grad()
    return params_of(model)


def assert_close_lists(a, b, **tol):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, **tol)


def test_scope_sets_current_strategy_and_reductions_agree(results):
    for r in results:
        assert r["scope_current"]
        assert r["mean"] == pytest.approx(1.5)
        assert r["max"] == pytest.approx(2.0)


def test_ddp_matches_one_process_on_the_same_global_batch(results):
    ref = reference(STEPS)
    for r in results:  # averaging over ranks reorders FP32 sums: a few ULPs
        assert_close_lists(r["ddp"], ref, rtol=1e-5, atol=1e-6)
    assert_close_lists(results[0]["ddp"], results[1]["ddp"], rtol=0, atol=0)


def test_no_sync_skips_allreduce_on_accumulation_micro_steps(results):
    r = results[0]
    per_step = r["ddp_collectives"] // STEPS          # buckets per synchronised backward
    assert per_step >= 1
    assert r["accum_nosync_collectives"] == 3 * per_step
    assert r["accum_sync_collectives"] == 3 * 4 * per_step
    ref = reference(3, accum=4)
    for res in results:
        assert_close_lists(res["accum_nosync"], ref, rtol=1e-5, atol=1e-6)
        assert_close_lists(res["accum_nosync"], res["accum_sync"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("comp,ratio", [("fp16", 0.5), ("bf16", 0.5)])
def test_half_precision_compression_halves_the_bytes(results, comp, ratio):
    stats = results[0][comp]["stats"]
    assert stats["compression"] == comp
    assert stats["bytes_dense"] > 0
    assert stats["bytes_sent"] == ratio * stats["bytes_dense"]
    assert stats["values_sent"] == stats["values_dense"]
    ref = reference(STEPS)  # compressed averaging: within half-precision rounding of FP32
    assert_close_lists(results[0][comp]["params"], ref, rtol=0, atol=2e-3)
    assert_close_lists(results[0][comp]["params"], results[1][comp]["params"], rtol=0, atol=0)


def test_topk_sends_at_most_the_ratio_and_keeps_ranks_identical(results):
    stats = results[0]["topk"]["stats"]
    assert 0.29 <= stats["density"] <= 0.30
    # values (fp32) + int32 indices: 8 bytes per sent value vs 4 per dense value
    assert stats["bytes_sent"] == 8 * stats["values_sent"]
    assert stats["bytes_dense"] == 4 * stats["values_dense"]
    assert_close_lists(results[0]["topk"]["params"], results[1]["topk"]["params"], rtol=0, atol=0)


def test_topk_with_error_feedback_reaches_the_dense_loss(results):
    dense, topk = results[0]["conv_none"], results[0]["conv_topk"]
    assert topk["stats"]["density"] <= 0.30
    assert dense["stats"]["density"] == 1.0
    assert topk["loss"] <= 1.02 * dense["loss"], (topk["loss"], dense["loss"])
    assert results[1]["conv_topk"]["loss"] == topk["loss"]  # same model on every rank


def test_topk_residuals_round_trip_through_a_checkpoint(results):
    for r in results:
        assert r["topk_state_roundtrip"]
    per_rank = results[0]["topk_state_rank0"]["per_rank"]
    assert len(per_rank) == WORLD
    res0, res1 = (per_rank[i][0]["residuals"] for i in range(WORLD))
    assert res0 and any(not torch.equal(res0[k], res1[k]) for k in res0)  # residuals are per rank


def test_checkpoint_read_on_rank0_only_reaches_every_rank(results):
    assert all(r["loaded"] for r in results)


def test_inf_on_one_rank_skips_the_step_on_every_rank(results):
    want = [step in INJECT_AT for step in range(OVF_STEPS)]
    for r in results:
        assert r["overflow"]["skipped"] == want
        assert r["overflow"]["num_skipped"] == len(INJECT_AT)


def test_loss_scale_is_identical_on_all_ranks(results):
    a, b = (r["overflow"]["scales"] for r in results)
    assert a == b
    for step in INJECT_AT:                 # backed off at each overflow (and grew in between)
        assert a[step] == a[step - 1] / 2
    assert max(a) > 2.0 ** 8


def test_parameters_stay_identical_across_ranks(results):
    for p0, p1 in zip(results[0]["overflow"]["params"], results[1]["overflow"]["params"]):
        torch.testing.assert_close(p0, p1, rtol=0, atol=0)


def test_control_per_rank_decisions_diverge(results):
    """torch.amp.GradScaler decides per rank: rank 0 steps while rank 1 skips."""
    assert results[0]["overflow_torch"]["skipped"] != results[1]["overflow_torch"]["skipped"]
    assert any(not torch.equal(p0, p1) for p0, p1 in
               zip(results[0]["overflow_torch"]["params"], results[1]["overflow_torch"]["params"]))
