"""Shared helpers for the amp tests: a tiny model, snapshots, and a fake master-weight optimizer.

``FakeMasterOptimizer`` follows the grad protocol of docs/CONTRACTS.md (``master_grads()``) so the
scaler can be tested against it before mixprec.optim exists; it is deliberately minimal.
"""
from __future__ import annotations

import copy

import torch
from torch import nn


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def batches(n: int, seed: int = 1, batch: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 6, generator=g), torch.randn(batch, 3, generator=g)) for _ in range(n)]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    return (model(x.to(dtype)).float() - y).pow(2).mean()


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Deep copies of the parameters and the optimizer state, for bitwise comparison."""
    return {"params": [p.detach().clone() for p in model.parameters()],
            "opt": copy.deepcopy(optimizer.state_dict())}


def assert_bitwise_equal(a, b, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        # compare bit patterns so that -0.0/0.0 and NaN payloads count as differences
        ia = a.contiguous().view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8)
        ib = b.contiguous().view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8)
        assert torch.equal(ia, ib), f"{path} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


class FakeMasterOptimizer:
    """FP32 masters for low-precision model params, stepping an inner torch optimizer on them."""

    def __init__(self, params, inner_cls=torch.optim.SGD, **kwargs):
        self.model_params = [p for p in params]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.model_params]
        self.inner = inner_cls(self.masters, **kwargs)
        self._grads_moved = False
        self.master_grads_calls = 0

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def master_grads(self) -> list[torch.Tensor]:
        self.master_grads_calls += 1
        if not self._grads_moved:
            for p, m in zip(self.model_params, self.masters):
                m.grad = None if p.grad is None else p.grad.float()
            self._grads_moved = True
        return [m.grad for m in self.masters if m.grad is not None]

    @torch.no_grad()
    def step(self):
        self.master_grads()
        self.inner.step()
        torch._foreach_copy_(self.model_params, self.masters)
        self._grads_moved = False

    def zero_grad(self, set_to_none: bool = True):
        for p in self.model_params:
            p.grad = None
        self.inner.zero_grad(set_to_none)
        self._grads_moved = False

    def state_dict(self):
        return {"inner": self.inner.state_dict(), "masters": [m.detach().clone() for m in self.masters]}
