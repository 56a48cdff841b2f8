"""The scaler with mixprec.optim's real master-weight optimizers (the grad protocol end to end)."""
from __future__ import annotations

import math

import pytest
import torch
from amp_helpers import assert_bitwise_equal, batches, loss_of, tiny_model

from mixprec.amp import GradScaler, clip_grad_norm_

optim = pytest.importorskip("mixprec.optim")


@pytest.mark.parametrize("make", [
    lambda m: optim.AdamW(m.parameters(), lr=1e-2, fp16_params=True),
    lambda m: optim.MasterWeights(torch.optim.SGD, m.parameters(), lr=0.1, momentum=0.9,
                                  param_dtype=torch.float16),
])
def test_fp16_params_with_masters_train_skip_and_clip(make):
    model = tiny_model()
    opt = make(model)
    assert next(model.parameters()).dtype == torch.float16
    scaler = GradScaler(init_scale=2.0 ** 10)
    data = batches(6)
    first = last = None
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = loss_of(model, x, y)
        scaler.scale(loss * (math.inf if i == 3 else 1.0)).backward()
        norm = clip_grad_norm_(scaler, opt, 1.0)
        grads = opt.master_grads()
        assert all(g.dtype == torch.float32 for g in grads)
        if i == 3:
            before = [p.detach().clone() for p in model.parameters()], \
                [m.detach().clone() for g in opt.param_groups for m in g["params"]]
        scaler.step(opt)
        scaler.update()
        assert scaler.last_step_skipped == (i == 3)
        if i == 3:
            after = [p.detach().clone() for p in model.parameters()], \
                [m.detach().clone() for g in opt.param_groups for m in g["params"]]
            assert_bitwise_equal(after, before)
            assert not math.isfinite(norm.item())
        else:
            assert norm.item() < 1e3
        first = first if first is not None else loss.item()
        last = loss.item()
    assert scaler.num_skipped_steps == 1 and scaler.get_scale() == 2.0 ** 9 and last < first
