"""NumericsMonitor: exact range fractions, hooks only on sampled steps, one host sync per sample."""
import math

import pytest
import torch
from torch import nn

from mixprec.monitor.stats import NUMERICS_COLUMNS, NumericsMonitor, range_counts, ulp, update_counts
from mixprec.precision import format_info

F16, BF16, E4M3, E5M2 = torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2


def _counts(x, dt):
    return range_counts(x, dt).tolist()


def test_fp16_fractions_on_constructed_tensor():
    # 3 overflow (65520 rounds to inf; 65519 does not), 2 flush (<= 2**-25), 2 subnormal, 1 zero
    x = torch.tensor([1.0, -2.0, 65519.0, 65520.0, -1e6, float("inf"), 2.0 ** -25, -1e-9,
                      3e-8, 1e-6, 6.1e-5, 0.0])
    amax, over, flush, sub = _counts(x, F16)
    assert (over, flush, sub) == (3, 2, 3)  # 3e-8, 1e-6 are subnormal; 6.1e-5 rounds up to tiny
    assert amax == math.inf
    # the same verdict as a real cast, value by value
    y = x.half()
    assert int((~torch.isfinite(y)).sum()) == over
    assert int(((y == 0) & (x != 0)).sum()) == flush


def test_fractions_agree_with_a_real_cast_on_random_data():
    torch.manual_seed(0)
    x = torch.randn(10_000) * torch.exp(torch.randn(10_000) * 12)  # spans ~1e-15 .. 1e15
    for dt in (F16, BF16, E5M2):
        amax, over, flush, sub = _counts(x, dt)
        y = x.to(dt).float()
        fi = format_info(dt)
        assert over == int((~torch.isfinite(y)).sum()), dt
        assert flush == int(((y == 0) & (x != 0)).sum()), dt
        assert sub == int(((y != 0) & (y.abs() < fi.tiny) & torch.isfinite(y)).sum()), dt


def test_e4m3_overflow_counted_although_the_cast_saturates():
    x = torch.tensor([448.0, 463.0, 464.0, 1000.0, 1e-3, 9.7e-4, 1e-2])
    amax, over, flush, sub = _counts(x, E4M3)
    assert (over, flush, sub) == (2, 1, 2)  # 464, 1000 | 9.7e-4 (<= 2**-10) | 1e-3, 1e-2 (< 2**-6)


def test_ulp_matches_nextafter_and_update_loss_fraction():
    x = torch.tensor([1.0, 3.0, 1000.0, 1e-6])
    assert ulp(x, BF16).tolist() == [2 ** -7, 2 ** -6, 2 ** 2, 2 ** -27]
    assert ulp(torch.tensor([1e-6, 0.0]), F16).tolist() == [format_info(F16).smallest_subnormal] * 2
    up = torch.nextafter(x.half(), torch.full_like(x.half(), math.inf)).float() - x.half().float()
    assert torch.equal(ulp(x.half(), F16)[:3], up[:3])
    before = torch.ones(8)
    delta = torch.tensor([1e-9, 1e-8, 5e-8, 1e-7, 1e-3, -1e-9, 0.0, 1.0])  # fp32 ulp(1)=1.19e-7
    after = before + delta  # in fp32 the tiny ones vanish
    _, bad, lost, changed = update_counts(before, after, torch.float32).tolist()
    assert lost == 5 and changed == 3 and bad == 0
    # FP32 masters asked about BF16 storage: ulp(1) = 2**-7, so everything below 2**-8 is lost
    _, _, lost_bf16, _ = update_counts(before, before + delta.double().float(), BF16).tolist()
    assert lost_bf16 == 7


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
               + len(m._backward_pre_hooks) for m in model.modules())


def test_no_hooks_off_sampled_steps_and_none_left_after():
    model = _mlp()
    mon = NumericsMonitor(model, every=5)
    x = torch.randn(3, 4)
    for step in range(1, 5):
        assert not mon.should_sample(step)
        with mon.sample(step) as s:
            assert _hooks(model) == 0
            out = model(x)
            assert out.grad_fn is not None and not out._backward_hooks
            out.sum().backward()
            with mon.track_updates():
                pass
        assert s.rows == [] and not s.active
    with mon.sample(5) as s:
        assert _hooks(model) == 2  # the two Linear layers (default filter: leaves with params)
        model(x).sum().backward()
    assert _hooks(model) == 0
    assert {(r.module, r.kind) for r in s.rows} == {("0", "act"), ("2", "act"), ("0", "grad"), ("2", "grad")}


def test_sampled_step_rows_match_fp32_reference():
    model = _mlp()
    mon = NumericsMonitor(model, every=1, compute_dtype="fp16")
    x = torch.randn(3, 4) * 1e4
    with mon.sample(0) as s:
        h = model[0](x)
        out = model[2](model[1](h))
        (out.sum() * 2.0 ** 16).backward()
        w0 = [p.detach().clone() for p in model[0].parameters()]
        vanish = [((w - 1e-12 * p.grad) == w) for w, p in zip(w0, model[0].parameters())]
        with mon.track_updates(), torch.no_grad():
            for p in model.parameters():  # plain SGD, lr 1e-12
                p -= 1e-12 * p.grad
    rows = {(r.module, r.kind): r for r in s.rows}
    act0 = rows[("0", "act")]
    assert act0.absmax == pytest.approx(float(h.detach().abs().max()), rel=1e-6)
    assert act0.overflow_frac == pytest.approx(float((h.abs() >= 65520).float().mean()))
    assert rows[("2", "grad")].absmax == 2.0 ** 16  # d(sum)/d(out) = 1, times the loss scale
    assert rows[("2", "grad")].dtype == "fp16"
    upd = rows[("0", "update")]
    assert upd.dtype == "fp32" and upd.subnormal_frac is None
    expected = sum(int(v.sum()) for v in vanish) / sum(v.numel() for v in vanish)
    assert 0 < expected < 1 and upd.underflow_frac == pytest.approx(expected)  # lost in FP32
    assert list(rows[("0", "act")].to_dict()) == list(NUMERICS_COLUMNS)


def test_skipped_optimizer_step_gives_no_update_rows():
    model = _mlp()
    mon = NumericsMonitor(model, every=1)
    with mon.sample(0) as s:
        model(torch.randn(2, 4)).sum().backward()
        with mon.track_updates():
            pass  # the scaler skipped the step: nothing changed
    assert not [r for r in s.rows if r.kind == "update"]


def test_one_host_sync_per_sampled_step(monkeypatch):
    model = _mlp()
    mon = NumericsMonitor(model, every=1, compute_dtype=BF16)
    calls = []
    for name in ("item", "tolist", "__bool__", "cpu", "numpy"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=orig, _n=name, **k: (calls.append(_n), _o(self, *a, **k))[1])
    with mon.sample(0) as s:
        model(torch.randn(2, 4)).sum().backward()
        inside = list(calls)
    monkeypatch.undo()
    assert inside == [] and calls == ["tolist"]
    assert len(s.rows) == 4


def test_policy_and_fp8_dtypes():
    model = _mlp()
    assert NumericsMonitor(model, compute_dtype="bf16-mixed").act_dtype == BF16
    m = NumericsMonitor(model, compute_dtype="e4m3", grad_dtype="e5m2")
    assert (m.act_dtype, m.grad_dtype) == (E4M3, E5M2)
    with pytest.raises(ValueError, match="positive integer"):
        NumericsMonitor(model, every=0)


def test_module_filter_fn_selects_modules():
    model = _mlp()
    mon = NumericsMonitor(model, every=1, module_filter_fn=lambda m, fqn: isinstance(m, nn.ReLU))
    with mon.sample(0) as s:
        model(torch.randn(2, 4))
    assert [(r.module, r.kind) for r in s.rows] == [("1", "act")]


def test_grad_rows_record_the_loss_scale_they_carry():
    import mixprec as mp
    model = _mlp()
    precision = mp.Precision("16-mixed", init_scale=2.0 ** 12)
    mon = NumericsMonitor(model, every=1, compute_dtype=precision)
    with mon.sample(1) as s:
        (model(torch.randn(3, 4)).sum() * precision.scaler.get_scale()).backward()
    rows = {(r.module, r.kind): r for r in s.rows}
    assert rows[("2", "grad")].loss_scale == 2.0 ** 12
    assert rows[("2", "grad")].absmax / rows[("2", "grad")].loss_scale == 1.0   # d(sum)/d(out)
    assert rows[("0", "act")].loss_scale is None
    with mon.sample(2, loss_scale=8.0) as s:                 # a GradScaler's scale, passed in
        (model(torch.randn(3, 4)).sum() * 8.0).backward()
    assert {r.loss_scale for r in s.rows if r.kind == "grad"} == {8.0}
    plain = NumericsMonitor(model, every=1, compute_dtype="fp16")
    with plain.sample(1) as s:
        model(torch.randn(3, 4)).sum().backward()
    assert {r.loss_scale for r in s.rows} == {None}
