"""The autocast family: the forward's compute dtype, its output dtype, and the loss scale of FP16
compute over wider parameters (``16-mixed``)."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from mixprec.precision.autocast import autocast
from mixprec.precision.plugins.base import PrecisionPlugin

if TYPE_CHECKING:
    from mixprec.amp import GradScaler

__all__ = ["AutocastPlugin"]


class AutocastPlugin(PrecisionPlugin):
    """Runs the forward under :func:`mixprec.precision.autocast`: matmuls in the compute dtype
    where it is below the parameters' (``bf16-mixed``, ``16-mixed``), autocast off where it is
    FP32 (so FP32 means FP32, inside an enclosing autocast too), TF32 where the policy allows it.
    Every mode has one: for ``32-true`` it is the context that turns autocast off."""

    name = "autocast"

    def forward_context(self, device_type: str) -> contextlib.AbstractContextManager:
        return autocast(self.recipe.policy, device_type=device_type)

    def convert_output(self, x: Any) -> Any:
        """A floating tensor in the mode's output dtype; anything else as it is."""
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(self.recipe.policy.output_dtype)
        return x

    def scale_loss(self, loss: torch.Tensor, scaler: GradScaler, *,
                   scale: float | None = None) -> torch.Tensor:
        """Scaled where the mode scales and the parameters are wider than the FP16 compute
        (``16-mixed``); 16-bit storage scales in :class:`~.params.ParamsPlugin`: one of the two."""
        if self.recipe.scales_loss and not self.recipe.stores_low_precision:
            return scaler.scale(loss, value=scale)
        return loss
