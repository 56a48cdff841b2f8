"""What the training loop passes around: a batch, and what one optimizer step produced."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Batch", "StepOutput"]

Batch = Any
"""What a loader yields: ``(inputs, targets)`` (mixprec's token loaders: both ``int64`` of shape
``(B, T)``, the targets already shifted by one token), a dict with ``labels``, or an object with
``.to()``; :mod:`mixprec.models.objective` turns it into a loss."""


@dataclass
class StepOutput:
    """What one optimizer step produced. Tensors stay on the device (no host sync)."""

    loss: torch.Tensor          # mean loss over the micro-batches, fp32 scalar
    grad_norm: torch.Tensor | None  # unscaled global gradient norm (None when not computed)
    skipped: bool               # the optimizer step was skipped (non-finite gradients)
    scale_before: float         # loss scale used for this step
    tokens: torch.Tensor | int | None  # real (non-padding) tokens on this rank; None: not tokens
    lr: Any = None              # the learning rate this step ran at (the first group's)
