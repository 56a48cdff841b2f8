"""What the training loop passes around: a batch, and what one optimizer step produced."""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Batch", "StepOutput"]

Batch = tuple[torch.Tensor, torch.Tensor]
"""``(inputs, targets)``, both ``int64`` of shape ``(B, T)``; ``targets`` are the inputs shifted
by one token (the data loader does the shift)."""


@dataclass
class StepOutput:
    """What one optimizer step produced. Tensors stay on the device (no host sync)."""

    loss: torch.Tensor          # mean loss over the micro-batches, fp32 scalar
    grad_norm: torch.Tensor | None  # unscaled global gradient norm (None when not computed)
    skipped: bool               # the optimizer step was skipped (non-finite gradients)
    scale_before: float         # loss scale used for this step
    tokens: int                 # tokens processed on this rank
