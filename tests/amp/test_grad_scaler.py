"""GradScaler: non-finite detection, skip atomicity, parity with an FP32 control run, accumulation,
multiple optimizers, misuse errors, host-sync count and the master-grad protocol."""
from __future__ import annotations

import math

import pytest
import torch
from amp_helpers import (FakeMasterOptimizer, assert_bitwise_equal, batches, loss_of, snapshot,
                         tiny_model)

import mixprec.amp.unscale as gs
from mixprec.amp import GradScaler
from mixprec.errors import ConfigError

BAD = {"+inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _grad_with(layout: str, dtype: torch.dtype, pos: str | None, value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A (5, 7) gradient in ``layout`` filled with small finite values, one of them ``value``."""
    base = torch.linspace(-3, 3, 35).reshape(5, 7)
    if layout == "contiguous":
        g = base.to(dtype).clone()
    elif layout == "transposed":
        g = base.t().contiguous().to(dtype).t()                       # strides (1, 5)
    else:
        store = torch.zeros(10, 9, dtype=dtype)
        g = store[::2, 1:8]                                           # strided view
        g.copy_(base)
    assert g.shape == (5, 7) and (layout == "contiguous") == g.is_contiguous()
    if pos is not None:
        idx = {"first": (0, 0), "middle": (2, 3), "last": (4, 6)}[pos]
        g[idx] = value
    return g, base


@pytest.fixture(params=["fused", "foreach-fallback"])
def unscale_path(request, monkeypatch):
    """Run a test on torch's fused kernel and on the foreach fallback (used for BF16 on CUDA)."""
    if request.param == "foreach-fallback":
        for dt in (torch.float16, torch.bfloat16, torch.float32):
            monkeypatch.setitem(gs._FUSED_OK, ("cpu", dt), False)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
@pytest.mark.parametrize("pos", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", list(BAD))
def test_nonfinite_gradient_is_detected_and_step_skipped(dtype, layout, pos, bad, unscale_path):
    p = torch.nn.Parameter(torch.zeros(5, 7, dtype=dtype))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))                       # a loss was scaled (resolves the device)
    p.grad, _ = _grad_with(layout, dtype, pos, BAD[bad])
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped and scaler.num_skipped_steps == 1 and scaler.num_overflows == 1
    assert torch.equal(p.detach(), torch.zeros(5, 7, dtype=dtype))
    assert scaler.get_scale() == 2.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_finite_gradient_is_unscaled_exactly_in_place(dtype, layout, unscale_path):
    p = torch.nn.Parameter(torch.zeros(5, 7, dtype=dtype))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))
    g, base = _grad_with(layout, dtype, None, 0.0)
    g.mul_(8.0)
    p.grad = g
    scaler.unscale_(opt)
    assert p.grad is g                                  # in place, the view is kept
    assert torch.equal(g, base.to(dtype))               # power-of-two unscale is exact
    scaler.step(opt)
    scaler.update()
    assert not scaler.last_step_skipped and torch.equal(p.detach(), -base.to(dtype))


# --- skip atomicity and parity with an FP32 control run -------------------------------------------

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_skipped_step_leaves_params_and_optimizer_state_bitwise_unchanged(name):
    model = tiny_model()
    opt = OPTIMIZERS[name](model.parameters())
    scaler = GradScaler(init_scale=2.0 ** 10)
    data = batches(4)
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        scaler.scale(loss_of(model, x, y)).backward()
        if i == 3:
            before = snapshot(model, opt)
            model[0].weight.grad[1, 2] = math.nan
        scaler.step(opt)
        scaler.update()
    assert scaler.last_step_skipped
    assert_bitwise_equal(snapshot(model, opt), before)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_training_matches_fp32_control_run_that_skips_the_same_steps(name):
    """Power-of-two scales make scale/unscale exact, so the runs agree to rounding (rtol 1e-6)."""
    bad_steps = {2, 5, 6}
    data = batches(10)
    model, control = tiny_model(), tiny_model()
    opt, copt = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](control.parameters())
    scaler = GradScaler(init_scale=2.0 ** 12, growth_interval=2)
    scales = []
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        scaler.scale(loss_of(model, x, y)).backward()
        if i in bad_steps:
            model[2].bias.grad[0] = math.inf
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        copt.zero_grad()
        loss_of(control, x, y).backward()
        if i not in bad_steps:
            copt.step()
    assert scaler.num_skipped_steps == len(bad_steps)
    assert scales == [4096, 8192, 4096, 4096, 8192, 4096, 2048, 2048, 4096, 4096]
    for p, q in zip(model.parameters(), control.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_real_fp16_overflow_backs_off_until_it_fits_and_params_stay_finite():
    model = tiny_model(dtype=torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = GradScaler(init_scale=2.0 ** 24)          # far too large for fp16 grads
    for x, y in batches(20):
        opt.zero_grad()
        scaler.scale(loss_of(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
    assert 0 < scaler.num_skipped_steps < 20 and scaler.get_scale() <= 2.0 ** 16
    assert all(torch.isfinite(p).all() for p in model.parameters())


# --- accumulation, multiple optimizers ------------------------------------------------------------

def test_gradient_accumulation_over_micro_batches_matches_full_batch_fp32():
    model, ref = tiny_model(), tiny_model()
    opt, ropt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = GradScaler(init_scale=2.0 ** 8, growth_interval=1)   # grows every step: the scale
    micro = batches(4, batch=2)                                    # must stay fixed within one
    for _ in range(3):
        opt.zero_grad()
        s0 = scaler.get_scale()
        for x, y in micro:
            loss = loss_of(model, x, y) / len(micro)
            scaled = scaler.scale(loss)
            assert torch.equal(scaled, loss * s0)
            scaled.backward()
        scaler.step(opt)
        scaler.update()
        ropt.zero_grad()
        x, y = torch.cat([b[0] for b in micro]), torch.cat([b[1] for b in micro])
        loss_of(ref, x, y).backward()
        ropt.step()
    assert scaler.get_scale() == 2.0 ** 11
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_overflow_in_one_micro_batch_skips_the_whole_accumulated_step():
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters())
    scaler = GradScaler()
    before = snapshot(model, opt)
    for i, (x, y) in enumerate(batches(3)):
        loss = loss_of(model, x, y) * (math.inf if i == 1 else 1.0)
        scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped and scaler.get_scale() == 2.0 ** 15
    assert_bitwise_equal(snapshot(model, opt), before)


def test_multiple_optimizers_each_skip_on_their_own_and_the_scale_backs_off_once():
    m1, m2 = tiny_model(0), tiny_model(1)
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.Adam(m2.parameters())
    scaler = GradScaler(init_scale=64.0, growth_interval=1)
    x, y = batches(1)[0]
    for step in range(2):
        o1.zero_grad()
        o2.zero_grad()
        l1, l2 = loss_of(m1, x, y), loss_of(m2, x, y)
        for scaled in scaler.scale([l1, l2]):
            scaled.backward()
        if step == 1:
            m2[0].bias.grad[0] = math.nan
            before1, before2 = snapshot(m1, o1), snapshot(m2, o2)
        scaler.step(o1)
        scaler.step(o2)
        scaler.update()
    assert scaler.get_scale() == 64.0                 # grew to 128, then one backoff
    assert scaler.num_skipped_steps == 1 and scaler.num_overflows == 1 and scaler.last_step_skipped
    assert_bitwise_equal(snapshot(m2, o2), before2)
    assert not torch.equal(m1[0].weight, before1["params"][0])


# --- misuse ---------------------------------------------------------------------------------------

def _one_backward(scaler, model, opt):
    x, y = batches(1)[0]
    opt.zero_grad()
    scaler.scale(loss_of(model, x, y)).backward()


def test_second_unscale_or_step_without_update_raises_clearly():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler()
    _one_backward(scaler, model, opt)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already called .* exactly once"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) was already called"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    scaler.update()
    with pytest.raises(RuntimeError, match="update\\(\\) called without"):
        scaler.update()
    _one_backward(scaler, model, opt)
    with pytest.raises(RuntimeError, match="closures are not supported"):
        scaler.step(opt, closure=lambda: None)


@pytest.mark.parametrize("kwargs, match", [
    (dict(init_scale=0.0), "init_scale"), (dict(init_scale=math.nan), "finite"),
    (dict(growth_factor=1.0), "scale_factor"), (dict(backoff_factor=1.0), "backoff_factor"),
    (dict(growth_interval=0), "scale_window"), (dict(hysteresis=0), "hysteresis"),
    (dict(max_scale=math.inf), "max_scale"), (dict(enabled="yes"), "enabled"),
    (dict(device="gpu0"), "device"), (dict(on_min_scale="abort"), "on_min_scale"),
])
def test_gradscaler_settings_are_validated(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        GradScaler(**kwargs)


# --- scaling off: the check still protects --------------------------------------------------------

def test_from_policy_turns_scaling_on_only_for_fp16():
    assert GradScaler.from_policy("16-mixed").is_enabled()
    bf16 = GradScaler.from_policy("bf16-mixed")
    assert not bf16.is_enabled() and bf16.get_scale() == 1.0
    loss = torch.ones((), requires_grad=True)
    assert bf16.scale(loss) is loss


@pytest.mark.parametrize("check_finite, skipped", [(True, True), (False, False)])
def test_without_scaling_nonfinite_grads_still_skip_unless_switched_off(check_finite, skipped):
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = GradScaler.from_policy("bf16-true", check_finite=check_finite)
    p.grad = torch.tensor([1.0, math.inf, 2.0], dtype=torch.bfloat16)
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped is skipped
    assert torch.isfinite(p).all().item() is skipped
    assert torch.equal(p.grad[[0, 2]], torch.tensor([1.0, 2.0], dtype=torch.bfloat16))  # not scaled


def test_update_with_new_scale_sets_it_within_bounds():
    scaler = GradScaler(init_scale=8.0)
    scaler.update(new_scale=32.0)
    assert scaler.get_scale() == 32.0
    scaler.update(new_scale=torch.tensor(16.0))
    assert scaler.get_scale() == 16.0
    with pytest.raises(ConfigError, match="min_scale, max_scale"):
        scaler.update(new_scale=0.0)


# --- host syncs ---------------------------------------------------------------------------------

def test_exactly_one_host_sync_per_optimizer_step(monkeypatch):
    calls = []
    for name in ("item", "__bool__", "__float__", "tolist", "cpu"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _o=orig, _n=name, **k: (calls.append(_n), _o(self, *a, **k))[1])
    m1, m2 = tiny_model(0), tiny_model(1)
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    scaler = GradScaler(init_scale=2.0 ** 10, growth_interval=1)
    x, y = batches(1)[0]
    (loss_of(m1, x, y) + loss_of(m2, x, y)).mul(1.0)  # warm-up outside the count
    calls.clear()
    scaler.scale(loss_of(m1, x, y) + loss_of(m2, x, y)).backward()
    scaler.unscale_(o1)
    assert calls == []
    scaler.step(o1)
    assert calls == ["item"]
    scaler.step(o2)
    scaler.update()
    scaler.get_scale()
    assert calls == ["item", "item"]


# --- master-weight protocol -----------------------------------------------------------------------

def test_master_grads_are_unscaled_and_model_grads_left_alone():
    model = tiny_model(dtype=torch.float16)
    opt = FakeMasterOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    scaler = GradScaler(init_scale=2.0 ** 8)
    x, y = batches(1)[0]
    scaler.scale(loss_of(model, x, y)).backward()
    scaled_model_grad = model[0].weight.grad.clone()
    scaler.step(opt)
    scaler.update()
    assert opt.master_grads_calls >= 1 and not scaler.last_step_skipped
    torch.testing.assert_close(opt.masters[0].grad, scaled_model_grad.float() / 2 ** 8, rtol=0, atol=0)
    assert torch.equal(model[0].weight.grad, scaled_model_grad)
    assert torch.equal(model[0].weight.detach(), opt.masters[0].detach().half())


def test_fp16_model_grad_overflow_is_caught_in_the_master_grads_and_masters_stay_bitwise():
    model = tiny_model(dtype=torch.float16)
    opt = FakeMasterOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    scaler = GradScaler(init_scale=2.0 ** 10)
    x, y = batches(1)[0]
    scaler.scale(loss_of(model, x, y)).backward()
    scaler.step(opt)
    scaler.update()
    before = [m.detach().clone() for m in opt.masters], snapshot(model, opt.inner)
    opt.zero_grad()
    scaler.scale(loss_of(model, x, y) * 1e6).backward()          # scaled grads exceed 65504
    assert not torch.isfinite(model[2].weight.grad).all()
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped and scaler.get_scale() == 2.0 ** 9
    assert_bitwise_equal(([m.detach() for m in opt.masters], snapshot(model, opt.inner)), before)


# --- hysteresis, stuck scale, mixed dtypes, device ------------------------------------------------

def _nan_steps(scaler, n, p, opt):
    for _ in range(n):
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        p.grad[0] = math.nan
        scaler.step(opt)
        scaler.update()


def test_hysteresis_delays_the_backoff_but_every_overflow_still_skips():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = GradScaler(init_scale=64.0, hysteresis=3)
    _nan_steps(scaler, 2, p, opt)
    assert scaler.get_scale() == 64.0 and scaler.num_skipped_steps == 2
    _nan_steps(scaler, 1, p, opt)
    assert scaler.get_scale() == 32.0 and torch.equal(p.detach(), torch.ones(2))


def test_scale_stuck_at_min_scale_raises_numerics_error_and_warn_mode_continues():
    from mixprec.errors import NumericsError
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = GradScaler(init_scale=2.0, min_scale=1.0)
    _nan_steps(scaler, 1, p, opt)
    with pytest.raises(NumericsError, match="stuck at min_scale=1"):
        _nan_steps(scaler, 1, p, opt)
    assert scaler.num_skipped_steps == 2 and torch.equal(p.detach(), torch.ones(2))
    _nan_steps(scaler, 0, p, opt)
    warn = GradScaler(init_scale=1.0, min_scale=1.0, on_min_scale="warn")
    with pytest.warns(RuntimeWarning, match="stuck"):
        _nan_steps(warn, 3, p, opt)
    assert warn.num_skipped_steps == 3 and warn.get_scale() == 1.0


@pytest.mark.parametrize("bad_dtype", [torch.float16, torch.float32])
def test_one_optimizer_with_mixed_grad_dtypes_checks_every_group(bad_dtype):
    ps = [torch.nn.Parameter(torch.zeros(4, dtype=dt)) for dt in (torch.float16, torch.float32, torch.bfloat16)]
    opt = torch.optim.SGD(ps, lr=1.0)
    scaler = GradScaler(init_scale=4.0)
    scaler.scale(torch.ones(()))
    for p in ps:
        p.grad = torch.full((4,), 8.0, dtype=p.dtype)
        if p.dtype == bad_dtype:
            p.grad[-1] = math.inf
    scaler.unscale_(opt)
    assert all(torch.equal(p.grad[:3].float(), torch.full((3,), 2.0)) for p in ps)
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped and all((p == 0).all() for p in ps)


def test_cuda_scaler_without_cuda_warns_and_disables_scaling():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = GradScaler("cuda")
    assert not scaler.is_enabled() and scaler.get_scale() == 1.0


def test_torch_fused_adam_steps_on_unscaled_grads_and_skips_atomically():
    model, ref = tiny_model(), tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    ropt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    scaler = GradScaler(init_scale=2.0 ** 10)
    for i, (x, y) in enumerate(batches(3)):
        opt.zero_grad()
        scaler.scale(loss_of(model, x, y) * (math.inf if i == 1 else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        ropt.zero_grad()
        loss_of(ref, x, y).backward()
        if i != 1:
            ropt.step()
    assert scaler.num_skipped_steps == 1
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
