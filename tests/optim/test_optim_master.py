"""MasterWeights: sub-ULP accumulation, parity with torch optimizers, the grad protocol, skips."""
from __future__ import annotations

import pytest
import torch

from mixprec.errors import ConfigError
from mixprec.optim import AdamW, MasterWeights

OPTIMIZERS = [
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}),
    (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 1e-3}),
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
]


def _fp16_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).half()


def _random_grads(params, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]


def test_sub_ulp_updates_accumulate_in_the_master_but_not_in_a_plain_fp16_param():
    lr, steps = 1e-4, 100  # lr * grad = 1e-4 < half the FP16 ULP at 1.0 (2**-11 ~ 4.9e-4)
    plain = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    mastered = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    plain_opt = torch.optim.SGD([plain], lr=lr)
    opt = MasterWeights(torch.optim.SGD, [mastered], lr=lr)
    for _ in range(steps):
        plain.grad = torch.ones_like(plain)
        mastered.grad = torch.ones_like(mastered)
        plain_opt.step()
        opt.step()
    assert torch.equal(plain, torch.ones_like(plain))  # every update rounded away
    master = opt.master_of(mastered)
    assert master.dtype == torch.float32
    fp32_sum = torch.ones(4)
    for _ in range(steps):
        fp32_sum.add_(torch.ones(4), alpha=-lr)
    assert torch.equal(master, fp32_sum)  # exactly the FP32 recurrence
    torch.testing.assert_close(master, torch.full((4,), 1.0 - steps * lr), rtol=0, atol=1e-5)
    assert torch.equal(mastered.detach(), master.half())  # the model shows the accumulated change
    assert float(mastered.detach()[0]) < 1.0


@pytest.mark.parametrize(("cls", "kwargs"), OPTIMIZERS, ids=lambda x: getattr(x, "__name__", ""))
def test_masters_follow_the_fp32_optimizer_bitwise_given_the_same_grads(cls, kwargs):
    model = _fp16_model()
    ref = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = MasterWeights(cls, model.parameters(), **kwargs)
    ref_opt = cls(ref, **kwargs)
    for step in range(5):
        grads = _random_grads(list(model.parameters()), step)  # FP16 grads
        for p, r, g in zip(model.parameters(), ref, grads):
            p.grad = g
            r.grad = g.float()
        opt.step()
        ref_opt.step()
    for p, r in zip(model.parameters(), ref):
        assert torch.equal(opt.master_of(p), r.detach())  # master math is the FP32 optimizer's
        assert torch.equal(p.detach(), r.detach().half())  # the model is the master rounded


@pytest.mark.parametrize(("cls", "kwargs"), OPTIMIZERS, ids=lambda x: getattr(x, "__name__", ""))
def test_fp32_params_are_their_own_master_and_match_torch_exactly(cls, kwargs):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ref = torch.nn.Linear(8, 4)
    ref.load_state_dict(model.state_dict())
    opt = MasterWeights(cls, model.parameters(), **kwargs)
    ref_opt = cls(ref.parameters(), **kwargs)
    assert opt.masters == []
    x = torch.randn(16, 8)
    for _ in range(4):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, r)


def test_fp16_training_with_masters_tracks_an_fp32_run():
    # End to end: a tiny regression trained with FP16 params + masters reaches the FP32 run's loss
    # (within 1.5x + 1e-4) and weights (within 2e-2).
    torch.manual_seed(0)
    x, w_true = torch.randn(256, 16), torch.randn(16, 1)
    y = x @ w_true
    ref = torch.nn.Linear(16, 1)
    model = torch.nn.Linear(16, 1)
    model.load_state_dict(ref.state_dict())
    opt = AdamW(model.parameters(), lr=5e-2, fp16_params=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=5e-2)
    initial_loss = (ref(x) - y).pow(2).mean().item()
    for _ in range(200):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            dtype = next(m.parameters()).dtype
            (m(x.to(dtype)).float() - y).pow(2).mean().backward()
            o.step()
    loss = (model(x.half()).float() - y).pow(2).mean()
    ref_loss = (ref(x) - y).pow(2).mean()
    assert ref_loss < 0.01 * initial_loss  # it did learn
    torch.testing.assert_close(opt.master_of(model.weight), ref.weight.detach(), rtol=2e-2, atol=2e-2)
    assert loss.item() <= 1.5 * ref_loss.item() + 1e-4  # FP16 inputs set a small floor


def test_lambda_lr_scheduler_drives_the_inner_optimizer():
    model = _fp16_model()
    opt = MasterWeights(torch.optim.SGD, model.parameters(), lr=0.1)
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5**epoch)
    p = next(model.parameters())
    for expected_lr in (0.1, 0.05, 0.025):
        assert opt.inner.param_groups[0]["lr"] == pytest.approx(expected_lr)
        before = opt.master_of(p).clone()
        p.grad = torch.ones_like(p)
        opt.step()
        torch.testing.assert_close(opt.master_of(p), before - expected_lr, rtol=0, atol=1e-6)
        sched.step()


def test_zero_grad_clears_model_and_master_grads():
    model = _fp16_model()
    opt = MasterWeights(torch.optim.SGD, model.parameters(), lr=0.1)
    model(torch.randn(2, 8).half()).sum().backward()
    grads = opt.master_grads()
    assert len(grads) == 4 and all(g.dtype == torch.float32 for g in grads)
    opt.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())
    assert all(torch.count_nonzero(m.grad) == 0 for m in opt.masters)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert all(m.grad is None for m in opt.masters)


def test_frozen_params_and_missing_grads_are_skipped():
    model = _fp16_model()
    first, second = model[0], model[2]
    first.weight.requires_grad_(False)
    opt = MasterWeights(torch.optim.AdamW, model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    masters_before = [opt.master_of(p).clone() for p in model.parameters()]
    second.weight.grad = torch.ones_like(second.weight)  # only this param has a grad
    assert [g.shape for g in opt.master_grads()] == [second.weight.shape]
    opt.step()
    for p, b, mb in zip(model.parameters(), before, masters_before):
        changed = p is second.weight
        assert torch.equal(p.detach(), b) != changed
        assert torch.equal(opt.master_of(p), mb) != changed
    assert set(opt.state) == {opt.master_of(second.weight)}


def test_param_groups_keep_their_own_lr_and_weight_decay():
    model = _fp16_model()
    groups = [{"params": model[0].parameters(), "lr": 0.1, "weight_decay": 0.5},
              {"params": model[2].parameters(), "lr": 0.01}]
    opt = MasterWeights(torch.optim.SGD, groups, lr=1.0, weight_decay=0.0)
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(0.1, 0.5), (0.01, 0.0)]
    w0, w2 = opt.master_of(model[0].weight).clone(), opt.master_of(model[2].weight).clone()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    torch.testing.assert_close(opt.master_of(model[0].weight), w0 - 0.1 * (1 + 0.5 * w0))
    torch.testing.assert_close(opt.master_of(model[2].weight), w2 - 0.01)


def test_skipped_step_leaves_params_masters_and_state_bitwise_unchanged():
    model = _fp16_model()
    opt = MasterWeights(torch.optim.Adam, model.parameters(), lr=1e-2)
    x = torch.randn(4, 8).half()
    model(x).float().sum().backward()
    opt.step()  # create state
    opt.zero_grad()
    params = [p.detach().clone() for p in model.parameters()]
    masters = [m.clone() for m in opt.masters]
    state = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state.items()}
    model(x).float().sum().backward()
    for g in opt.master_grads():  # a scaler finds an inf and does not call step()
        g.mul_(1 / 1024)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert all(torch.equal(m, q) for m, q in zip(opt.masters, masters))
    for k, v in opt.state.items():
        assert all(torch.equal(t, state[k][n]) for n, t in v.items())


def test_fake_scaler_flow_unscales_the_fp32_master_grads():
    scale = 1024.0
    model, ref_model = _fp16_model(), _fp16_model()
    opt = MasterWeights(torch.optim.SGD, model.parameters(), lr=0.1)
    ref = [p.detach().float().clone() for p in ref_model.parameters()]
    x = torch.randn(4, 8).half()
    for step in range(3):
        opt.zero_grad()
        (model(x).float().sum() * scale).backward()
        grads = opt.master_grads()  # what the scaler asks for
        assert grads is not None and all(g.dtype == torch.float32 for g in grads)
        assert opt.master_grads()[0] is grads[0]  # idempotent: no second copy
        torch._foreach_mul_(grads, 1.0 / scale)  # the scaler unscales in place
        found_inf = torch.stack([g.isfinite().all() for g in grads]).logical_not().any()
        expected = [r.add(p.grad.float() / scale, alpha=-0.1) for r, p in zip(ref, model.parameters())]
        if step == 1:  # simulate an overflow: the scaler skips this step
            found_inf = torch.tensor(True)
        if not found_inf:
            opt.step()  # uses the unscaled master grads, does not copy again
            ref = expected
        for p, r in zip(model.parameters(), ref):
            assert torch.equal(opt.master_of(p), r)


def test_master_grads_are_recopied_after_zero_grad_and_step():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    opt = MasterWeights(torch.optim.SGD, [p], lr=1.0)
    p.grad = torch.full_like(p, 2.0)
    assert opt.master_grads()[0].tolist() == [2.0] * 3
    p.grad = torch.full_like(p, 5.0)
    assert opt.master_grads()[0].tolist() == [2.0] * 3  # same step: not copied again
    opt.zero_grad()
    p.grad = torch.full_like(p, 5.0)
    assert opt.master_grads()[0].tolist() == [5.0] * 3


def test_add_param_group_makes_masters_for_new_params():
    model = _fp16_model()
    opt = MasterWeights(torch.optim.SGD, model[0].parameters(), lr=0.1)
    opt.add_param_group({"params": model[2].parameters(), "lr": 0.5})
    assert len(opt.masters) == 4 and opt.param_groups is opt.inner.param_groups
    model[2].bias.grad = torch.ones_like(model[2].bias)
    before = opt.master_of(model[2].bias).clone()
    opt.step()
    torch.testing.assert_close(opt.master_of(model[2].bias), before - 0.5)


def test_param_dtype_converts_fp32_params_in_place_with_exact_masters():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    original = model.weight.detach().clone()
    opt = MasterWeights(torch.optim.SGD, model.parameters(), lr=0.1, param_dtype=torch.bfloat16)
    assert model.weight.dtype == torch.bfloat16
    assert torch.equal(opt.master_of(model.weight), original)
    model(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()  # the model still trains
    opt.step()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda p: MasterWeights(torch.optim.SGD(p, lr=0.1), p), "class"),
        (lambda p: MasterWeights(torch.optim.SGD, [], lr=0.1), "empty"),
        (lambda p: MasterWeights(torch.optim.SGD, p + p, lr=0.1), "twice"),
        (lambda p: MasterWeights(torch.optim.SGD, p, master_dtype=torch.int32, lr=0.1), "floating"),
        (lambda p: MasterWeights(torch.optim.LBFGS, p), "LBFGS"),
    ],
)
def test_invalid_construction_raises_config_error(call, match):
    params = [torch.nn.Parameter(torch.ones(2, dtype=torch.float16))]
    with pytest.raises(ConfigError, match=match):
        call(params)


def test_torch_grad_scaler_works_when_master_grads_is_called_before_it():
    # torch.amp.GradScaler only sees optimizer.param_groups (the masters): moving the grads first
    # lets it unscale and check the FP32 master grads; step() then does not copy again.
    model = _fp16_model()
    opt = MasterWeights(torch.optim.SGD, model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(model(torch.ones(2, 8).half()).float().sum()).backward()
    expected = [opt.master_of(p).add(p.grad.float() / 1024.0, alpha=-0.1) for p in model.parameters()]
    opt.master_grads()
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(opt.master_of(p), e) for p, e in zip(model.parameters(), expected))
