"""GradScaler on a GPU beside torch's fused AdamW: the fused check-and-unscale kernel runs on the
CUDA gradients, the fused optimizer steps on unscaled gradients (a power-of-two scale is exact, so
the weights follow an unscaled FP32 run), and a non-finite step is skipped as a whole."""
from __future__ import annotations

import math

import pytest
import torch

import mixprec.amp.unscale as unscale
from mixprec.amp import GradScaler

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)).to(DEV)


def _batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 64, generator=g).to(DEV), torch.randn(32, 8, generator=g).to(DEV)) for _ in range(n)]


def _loss(model, x, y):
    return (model(x) - y).pow(2).mean()


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD])
def test_fused_unscale_with_a_fused_optimizer_follows_an_unscaled_run_and_skips_a_bad_step(opt_cls):
    model, ref = _model(), _model()
    kw = {"lr": 1e-2} | ({"momentum": 0.9} if opt_cls is torch.optim.SGD else {})
    opt = opt_cls(model.parameters(), fused=True, **kw)
    ref_opt = opt_cls(ref.parameters(), fused=True, **kw)
    scaler = GradScaler("cuda", init_scale=2.0 ** 12, growth_interval=1000)
    for i, (x, y) in enumerate(_batches(4)):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        scaler.scale(_loss(model, x, y) * (math.inf if i == 2 else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        if i == 2:                                      # skipped as a whole, scale halved
            assert scaler.last_step_skipped and scaler.get_scale() == 2.0 ** 11
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
            continue
        ref_opt.zero_grad()
        _loss(ref, x, y).backward()
        ref_opt.step()
    assert unscale._FUSED_OK.get(("cuda", torch.float32)) is True       # torch's fused kernel ran
    assert scaler.num_skipped_steps == 1
    for p, r in zip(model.parameters(), ref.parameters()):
        assert p.device.type == "cuda"
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-7)


def test_bf16_and_fp16_gradients_on_cuda_are_unscaled_and_checked_without_a_host_sync():
    # Whichever path the CUDA build takes for 16-bit gradients (fused kernel or foreach fallback),
    # an inf is found and finite values come back divided by the scale exactly.
    for dtype in (torch.bfloat16, torch.float16):
        p = torch.nn.Parameter(torch.zeros(1000, dtype=dtype, device=DEV))
        opt = torch.optim.SGD([p], lr=1.0)
        scaler = GradScaler("cuda", init_scale=8.0)
        scaler.scale(torch.ones((), device=DEV))
        p.grad = torch.full_like(p, 8.0)
        scaler.unscale_(opt)
        assert torch.equal(p.grad, torch.ones_like(p))
        scaler.step(opt)
        scaler.update()
        assert not scaler.last_step_skipped and torch.equal(p.detach(), -torch.ones_like(p))
        opt.zero_grad()
        scaler.scale(torch.ones((), device=DEV))
        p.grad = torch.full_like(p, 8.0)
        p.grad[-1] = float("nan")
        scaler.step(opt)
        scaler.update()
        assert scaler.last_step_skipped and torch.equal(p.detach(), -torch.ones_like(p))
