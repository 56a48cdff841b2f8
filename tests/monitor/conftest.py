"""Tiny models shared by the monitor tests (no dependency on mixprec.models)."""
import pytest
import torch
from torch import nn


class InfGrad(torch.autograd.Function):
    """Identity forward; the backward gradient is replaced by +inf (a seeded backward fault)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return torch.full_like(g, float("inf"))


class PoisonLinear(nn.Linear):
    """A Linear that can inject inf into its forward output or into its input-gradient."""

    poison: str | None = None

    def forward(self, x):
        if self.poison == "backward":
            x = InfGrad.apply(x)
        y = super().forward(x)
        if self.poison == "forward":
            y = y.clone()
            y[..., 0] = float("inf")
        return y


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = PoisonLinear(d, 2 * d)
        self.act = nn.ReLU(inplace=True)  # in-place on purpose: tracing must survive it
        self.drop = nn.Dropout(0.1)
        self.fc2 = PoisonLinear(2 * d, d)

    def forward(self, x):  # x: (B, d)
        return x + self.fc2(self.drop(self.act(self.fc1(self.norm(x)))))


class TinyNet(nn.Module):
    def __init__(self, d: int = 8, n: int = 3):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x):  # x: (B, d) -> (B, 1)
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.fixture
def inf_grad():
    """``inf_grad(x)``: identity forward whose backward gradient is +inf."""
    return InfGrad.apply


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    return TinyNet()
