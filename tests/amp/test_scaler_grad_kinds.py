"""Sparse and DTensor gradients go through the same unscale/check/clip path."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from mixprec.amp import GradScaler, clip_grad_norm_


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sparse_embedding_grads_are_unscaled_and_checked(dtype):
    emb = torch.nn.Embedding(10, 4, sparse=True).to(dtype)
    # Weights whose updates are exact: SGD applies row 3's two uncoalesced -1s one at a time, and
    # (w - 1) - 1 equals w - 2 only when no rounding happens. With random weights the test passed
    # or failed by the RNG state earlier tests left behind.
    with torch.no_grad():
        emb.weight.copy_(torch.arange(40, dtype=torch.float32).reshape(10, 4) / 8)
    opt = torch.optim.SGD(emb.parameters(), lr=1.0)
    scaler = GradScaler(init_scale=2.0 ** 6)
    idx = torch.tensor([1, 3, 3])
    before = emb.weight.detach().clone()
    scaler.scale(emb(idx).float().sum()).backward()
    scaler.step(opt)
    scaler.update()
    expected = before.clone()
    expected[1] -= 1
    expected[3] -= 2
    assert not scaler.last_step_skipped and torch.equal(emb.weight.detach(), expected)
    opt.zero_grad()
    scaler.scale(emb(idx).float().sum() * math.inf).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped and torch.equal(emb.weight.detach(), expected)


@pytest.fixture
def one_rank_mesh(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_dtensor_grads_are_unscaled_checked_and_clipped(one_rank_mesh):
    from torch.distributed.tensor import Shard, distribute_tensor
    p = torch.nn.Parameter(distribute_tensor(torch.zeros(8), one_rank_mesh, [Shard(0)]))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = GradScaler(init_scale=2.0 ** 4)
    p.grad = distribute_tensor(torch.full((8,), 3.0 * 2 ** 4), one_rank_mesh, [Shard(0)])
    norm = clip_grad_norm_(scaler, opt, max_norm=1e9)
    torch.testing.assert_close(norm.full_tensor() if hasattr(norm, "full_tensor") else norm,
                               torch.tensor(3.0 * math.sqrt(8)), rtol=1e-6, atol=0)
    scaler.step(opt)
    scaler.update()
    assert torch.equal(p.full_tensor(), torch.full((8,), -3.0))
    opt.zero_grad()
    p.grad = distribute_tensor(torch.tensor([0, 0, math.nan, 0, 0, 0, 0, 0.0]), one_rank_mesh, [Shard(0)])
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped and torch.equal(p.full_tensor(), torch.full((8,), -3.0))
