"""Evaluation: the mean validation loss of a model, through the same ``batch_loss`` the step uses
(the mode's autocast, the loss in FP32), reduced across ranks."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from mixprec.errors import ConfigError
from mixprec.strategies import Strategy
from mixprec.train.step import Batch

__all__ = ["evaluate"]


@torch.no_grad()
def evaluate(model: nn.Module, val_loader: Iterable[Batch],
             batch_loss: Callable[[nn.Module, Batch], tuple[torch.Tensor, Any]], strategy: Strategy,
             max_batches: int | None = None) -> float:
    """Mean validation loss over up to ``max_batches`` batches, reduced across ranks; the model
    evaluates in ``eval()`` mode and trains again after, and training's RNG stream is untouched."""
    model.eval()
    total = torch.zeros((), device=strategy.device)
    count = 0
    # Creating a loader iterator draws from the global RNG: keep training's stream untouched.
    with torch.random.fork_rng(devices=[]):
        for i, batch in enumerate(val_loader):
            if max_batches is not None and i >= max_batches:
                break
            total += batch_loss(model, batch)[0]
            count += 1
    model.train()
    if count == 0:
        raise ConfigError("the validation data gave no batch; use more validation data or a "
                          "smaller batch_size/seq_len")
    return strategy.reduce_mean(total / count)
