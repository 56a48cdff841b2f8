"""clip_grad_norm_: unscales first (once), clips what the optimizer uses, matches an FP32 reference."""
from __future__ import annotations

import math

import pytest
import torch
from amp_helpers import FakeMasterOptimizer, batches, loss_of, tiny_model

from mixprec.amp import GradScaler, clip_grad_norm_
from mixprec.errors import ConfigError


def _fp32_reference(max_norm: float, norm_type: float):
    ref = tiny_model()
    x, y = batches(1)[0]
    loss_of(ref, x, y).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
    return norm, [p.grad for p in ref.parameters()]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.05, 100.0])
def test_clipped_norm_and_grads_equal_the_fp32_reference(norm_type, max_norm):
    """Tolerance: rtol 1e-6 (the scale is a power of two, so unscaling is exact)."""
    ref_norm, ref_grads = _fp32_reference(max_norm, norm_type)
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(init_scale=2.0 ** 14)
    x, y = batches(1)[0]
    scaler.scale(loss_of(model, x, y)).backward()
    norm = clip_grad_norm_(scaler, opt, max_norm, norm_type)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    for p, g in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-9)
    scaler.step(opt)                       # must not unscale a second time
    scaler.update()
    assert not scaler.last_step_skipped
    for p, g in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-9)


def test_clip_on_master_grads_equals_fp32_reference_norm():
    """FP16 model grads differ from FP32 ones by fp16 rounding: tolerance rtol 2e-3."""
    ref_norm, _ = _fp32_reference(1e9, 2.0)
    model = tiny_model(dtype=torch.float16)
    opt = FakeMasterOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    scaler = GradScaler(init_scale=2.0 ** 12)
    x, y = batches(1)[0]
    scaler.scale(loss_of(model, x, y)).backward()
    norm = clip_grad_norm_(scaler, opt, 0.01)
    torch.testing.assert_close(norm, ref_norm, rtol=2e-3, atol=0)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(m.grad) for m in opt.masters]))
    torch.testing.assert_close(total, torch.tensor(0.01), rtol=1e-4, atol=0)
    assert all(m.grad.dtype == torch.float32 for m in opt.masters)


def test_clip_refuses_after_step_and_needs_a_scaler():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler()
    x, y = batches(1)[0]
    scaler.scale(loss_of(model, x, y)).backward()
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after scaler.step"):
        clip_grad_norm_(scaler, opt, 1.0)
    with pytest.raises(ConfigError, match="needs a mixprec.amp.GradScaler"):
        clip_grad_norm_(None, opt, 1.0)
    with pytest.raises(ConfigError, match="max_norm"):
        clip_grad_norm_(scaler, opt, 0.0)


def test_clip_after_explicit_unscale_does_not_unscale_twice():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(init_scale=2.0 ** 10)
    x, y = batches(1)[0]
    scaler.scale(loss_of(model, x, y)).backward()
    scaler.unscale_(opt)
    ref_norm, _ = _fp32_reference(1e9, 2.0)
    torch.testing.assert_close(clip_grad_norm_(scaler, opt, 1e9), ref_norm, rtol=1e-6, atol=0)


def test_clip_works_with_torch_gradscaler_too():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    x, y = batches(1)[0]
    scaler.scale(loss_of(model, x, y)).backward()
    ref_norm, _ = _fp32_reference(1e9, 2.0)
    torch.testing.assert_close(clip_grad_norm_(scaler, opt, 1e9), ref_norm, rtol=1e-6, atol=0)
    scaler.step(opt)
    scaler.update()
