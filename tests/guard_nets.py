"""The small two-block net the guard and re-planner tests train (tests/plan/test_guard.py,
tests/plan/test_replan.py, tests/distributed/test_dist_guard.py), and its data.

``Net``: an embedding, two pre-norm MLP blocks (``blocks.N.fc``, ``blocks.N.proj``) and a head,
initialised from seed 0. A test makes one layer misbehave by a hook, by a subclass's
``forward``, or (``boost=True``) by :meth:`Block.grow_outliers`. Importable from any test folder:
``tests/plan/conftest.py`` and ``tests/distributed/conftest.py`` put ``tests/`` on ``sys.path``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int = 32, h: int = 64, *, boost: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, h)
        self.proj = nn.Linear(h, d)
        self.register_buffer("boost", torch.ones(h) if boost else None)

    def grow_outliers(self, channels: tuple[int, ...] = (3, 40), gain: float = 1e4) -> None:
        """``channels`` of ``proj``'s input become ``gain`` times larger and the weights reading
        them shrink alike (the function is unchanged in exact arithmetic, its FP8 inputs are not)."""
        if self.boost[channels[0]] == 1:
            with torch.no_grad():
                self.boost[list(channels)] = gain
                self.proj.weight[:, list(channels)] /= gain

    def forward(self, x):
        h = F.gelu(self.fc(self.norm(x)))
        return x + self.proj(h if self.boost is None else h * self.boost)


class Net(nn.Module):
    def __init__(self, *, boost: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(256, 32)
        self.blocks = nn.ModuleList(Block(boost=boost) for _ in range(2))
        self.head = nn.Linear(32, 256)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def loader(seed: int = 0, n: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of 4 x 16 tokens of a learnable task (target = 7 * token + 3 mod 256)."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randint(0, 256, (4, 16), generator=g) for _ in range(n)]
    return [(x, (7 * x + 3) % 256) for x in xs]
