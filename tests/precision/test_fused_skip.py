"""torch's fused optimizers skip on the device (issue #35): ``Precision.step`` hands a
``fused=True`` optimizer the non-finite flag as torch's ``GradScaler.step`` does (its
``found_inf`` attribute) instead of reading it; so does a mixprec AdamW whose inner torch AdamW is
fused (fit()'s default on CUDA). The result is the host-decided path's, bit for bit."""
from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

import mixprec as mp
import mixprec.optim.inputs as inputs_mod
import mixprec.precision.precision as precision_mod
from mixprec.optim import AdamW, MasterWeights
from mixprec.optim.inputs import skips_on_device
from mixprec.precision import StepTaken

from tests.amp.test_lazy_scaler import Reads


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 1))


OPTIMIZERS = {
    "torch-fused-adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "torch-fused-sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
    "mixprec-adamw-fused": lambda ps: AdamW(ps, lr=1e-2, fused=True),
}


def _train(mode: str, make_opt, bad_steps: set[int], on_device: bool, monkeypatch,
           clip: float | None = None, steps: int = 8):
    """``steps`` steps of ``mode``; the loss is inf at ``bad_steps``. ``on_device=False``: the
    reference, the host reads the flag and calls ``step()`` or not (the path before)."""
    with monkeypatch.context() as m:
        if not on_device:
            m.setattr(precision_mod, "skips_on_device", lambda opt: False)
            m.setattr(inputs_mod, "skips_on_device", lambda opt: False)
        model = _model()
        precision = mp.Precision(mode, device="cpu", init_scale=2.0 ** 8, growth_interval=3)
        model, opt = precision.setup(model, make_opt)
        g = torch.Generator().manual_seed(1)
        taken, reads = [], []
        for i in range(steps):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, generator=g)
            with precision.autocast():
                loss = nn.functional.mse_loss(model(x).squeeze(-1).float(), y)
            if i in bad_steps:
                loss = loss * math.inf
            precision.backward(loss)
            with Reads() as r:
                t = precision.step(opt, clip_grad_norm=clip)
            reads.append(r.n)
            taken.append(t)
            opt.zero_grad()
        return dict(model=model, opt=opt, precision=precision, taken=taken, reads=reads)


def _state_bits(opt: torch.optim.Optimizer) -> list[tuple]:
    sd = opt.state_dict()
    out = []
    for k, st in sorted(sd["state"].items()):
        for key, t in sorted(st.items()):
            out.append((k, key, t.dtype, t.reshape(-1).view(torch.uint8).tolist()))
    return out


def _assert_same(a: dict, b: dict) -> None:
    for pa, pb in zip(a["model"].parameters(), b["model"].parameters()):
        assert pa.dtype == pb.dtype and torch.equal(pa.view(torch.uint8), pb.view(torch.uint8))
    assert _state_bits(a["opt"]) == _state_bits(b["opt"])
    assert [bool(t) for t in a["taken"]] == [bool(t) for t in b["taken"]]
    pa, pb = a["precision"], b["precision"]
    assert pa.scaler.state_dict() == pb.scaler.state_dict()
    assert pa.scaler.counters == pb.scaler.counters
    assert (pa.scaler.last_step_skipped, pa.scaler.get_scale()) == (pb.scaler.last_step_skipped, pb.scaler.get_scale())


@pytest.mark.parametrize("clip", [None, 1.0], ids=["no-clip", "clip"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("mode,bad", [("16-mixed", {0, 3, 4}), ("bf16-mixed", {0, 5}), ("32-true", {2})],
                         ids=["16-mixed-overflows", "bf16-mixed-inf", "32-true-inf"])
def test_a_fused_optimizer_skipped_on_the_device_gives_the_host_decided_bits(mode, bad, name, clip,
                                                                            monkeypatch):
    dev = _train(mode, OPTIMIZERS[name], bad, True, monkeypatch, clip)
    host = _train(mode, OPTIMIZERS[name], bad, False, monkeypatch, clip)
    assert [bool(t) for t in dev["taken"]] == [i not in bad for i in range(8)]
    _assert_same(dev, host)
    # After the first step taken the flag is not read: the step returns a StepTaken still on the
    # device. Until then (no state yet) the host decides: a skipped first step leaves no state, as
    # the step not taken does.
    after = min(i for i in range(8) if i not in bad) + 1
    if isinstance(dev["opt"], MasterWeights):       # torch's fused kernel, not the flat chunks
        assert dev["opt"]._flat is None
    else:                                            # (a mixprec optimizer reads inside its step)
        assert not any(isinstance(t, StepTaken) for t in dev["taken"][:after])
    assert all(isinstance(t, StepTaken) for t in dev["taken"][after:])
    assert sum(dev["reads"][after:]) == 0, dev["reads"]
    assert all(n >= 1 for n in host["reads"][after:]), host["reads"]    # the reference reads


def test_a_skipped_first_step_leaves_no_state():
    model = _model()
    precision = mp.Precision("bf16-mixed", device="cpu")
    model, opt = precision.setup(model, OPTIMIZERS["torch-fused-adamw"])
    precision.backward(model(torch.randn(2, 8)).sum() * math.inf)
    assert not skips_on_device(opt)
    assert precision.step(opt) is False and len(opt.state) == 0


def test_the_flag_handed_to_the_fused_kernel_is_deleted_after_the_step(monkeypatch):
    run = _train("16-mixed", OPTIMIZERS["torch-fused-adamw"], {2}, True, monkeypatch, steps=4)
    assert not hasattr(run["opt"], "found_inf") and not hasattr(run["opt"], "grad_scale")


def test_a_non_fused_torch_optimizer_is_still_decided_on_the_host():
    opt = torch.optim.AdamW(_model().parameters(), lr=1e-3, foreach=True)
    assert not skips_on_device(opt)


def _fused_or_not(fused: bool, model: nn.Module) -> AdamW:
    return AdamW(model.parameters(), lr=1e-2, **({"fused": True} if fused else {}))


def _steps(model: nn.Module, opt: torch.optim.Optimizer, seeds: range) -> None:
    for i in seeds:
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, generator=g)
        nn.functional.mse_loss(model(x).squeeze(-1), y).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("saved_fused", [False, True], ids=["foreach-to-fused", "fused-to-foreach"])
def test_a_checkpoint_resumes_across_fused_and_foreach_adamw(saved_fused):
    # fit()'s AdamW is fused on CUDA and foreach on a CPU: the same state_dict layout, so a run
    # saved on one resumes on the other, continuing as if the optimizer had switched in place.
    saved_model = _model()
    saved = _fused_or_not(saved_fused, saved_model)
    _steps(saved_model, saved, range(3))
    buf = io.BytesIO()
    torch.save({"model": saved_model.state_dict(), "opt": saved.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    # the layouts: the same keys, shapes and dtypes per parameter
    ref_model = _model()
    ref = _fused_or_not(not saved_fused, ref_model)
    _steps(ref_model, ref, range(3))
    a, b = ckpt["opt"]["state"], ref.state_dict()["state"]
    assert a.keys() == b.keys() and ckpt["opt"].keys() == ref.state_dict().keys()
    for k in a:
        assert {n: (t.shape, t.dtype) for n, t in a[k].items()} == {n: (t.shape, t.dtype) for n, t in b[k].items()}
    # resumed: a fresh optimizer of the other kind loads the checkpoint and steps on
    resumed_model = _model()
    resumed_model.load_state_dict(ckpt["model"])
    resumed = _fused_or_not(not saved_fused, resumed_model)
    resumed.load_state_dict(ckpt["opt"])
    # torch's load_state_dict puts back the saved groups' kernel choice (fit() puts its own back):
    # until then, no found_inf is handed to a step that would refuse it
    assert inputs_mod.takes_found_inf(resumed.inner) is False
    for group in resumed.param_groups:
        group["fused"], group["foreach"] = (None if saved_fused else True), None
    assert inputs_mod.takes_found_inf(resumed.inner) is not saved_fused
    _steps(resumed_model, resumed, range(3, 6))
    # uninterrupted: the saving optimizer switched to the other kernel in place
    for group in saved.param_groups:
        group["fused"] = not saved_fused
        group["foreach"] = None
    _steps(saved_model, saved, range(3, 6))
    for pa, pb in zip(resumed_model.parameters(), saved_model.parameters()):
        assert torch.equal(pa.view(torch.int32), pb.view(torch.int32))
    assert _state_bits(resumed) == _state_bits(saved)
    assert {float(st["step"]) for st in resumed.state_dict()["state"].values()} == {6.0}
