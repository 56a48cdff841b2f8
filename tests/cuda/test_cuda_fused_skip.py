"""On a GPU, fit()'s default AdamW for modes without separate masters is torch's fused one, and
``Precision.step`` skips it on the device: no host sync (issue #35). The CPU tests of the same
paths: tests/precision/test_fused_skip.py."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.optim import AdamW

pytestmark = pytest.mark.cuda


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).cuda()


@pytest.mark.parametrize("mode", ["bf16-mixed", "16-mixed", "32-true"])
def test_on_cuda_the_default_adamw_is_fused_and_said_so(mode):
    model = _net()
    precision = mp.Precision(mode, device="cuda")
    opt = precision.make_optimizer([{"params": list(model.parameters())}], lr=1e-3, model=model)
    assert isinstance(opt, AdamW) and opt.inner.defaults["fused"] is True
    assert any("fused" in n for n in precision.notes)


def test_on_cuda_bf16_true_keeps_the_flat_foreach_step():
    model = _net()
    precision = mp.Precision("bf16-true", device="cuda")
    model = precision.setup_module(model)
    opt = precision.make_optimizer([{"params": list(model.parameters())}], lr=1e-3, model=model)
    assert not opt.inner.defaults.get("fused")


@pytest.mark.parametrize("mode", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("kind", ["torch", "mixprec"])
def test_on_cuda_a_fused_step_skipped_on_the_device_makes_no_sync(mode, kind):
    model = _net()
    precision = mp.Precision(mode, device="cuda")
    make = ((lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)) if kind == "torch" else
            (lambda ps: AdamW(ps, lr=1e-3, fused=True)))
    model, opt = precision.setup(model, make)
    x, y = torch.randn(4, 8, device="cuda"), torch.randn(4, device="cuda")
    taken = []
    for i in range(5):
        with precision.autocast():
            loss = nn.functional.mse_loss(model(x).squeeze(-1).float(), y)
        if i == 3:
            loss = loss * math.inf
        precision.backward(loss)
        if i >= 1:                      # the first step creates the state: decided on the host
            torch.cuda.set_sync_debug_mode("error")
        try:
            taken.append(precision.step(opt, clip_grad_norm=1.0))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        opt.zero_grad()
    assert [bool(t) for t in taken] == [True, True, True, False, True]
    assert precision.scaler.num_skipped_steps == 1
