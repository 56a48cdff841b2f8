"""What the precision side hands an optimizer step, declared in one place.

Why a type: the scaler and the clip used to find an optimizer's gradients by probing for
methods (``master_grads``, ``deferred_grads``) and decided on the host whether to call ``step()``
at all, reading the non-finite flag first (a host sync per step on an accelerator). A mixprec
master-weight optimizer takes the decision itself, on the device: ``step(inputs=StepInputs(...))``
with the flag as a device tensor issues the whole update and keeps the old values where the flag
is raised (``torch.where`` on its flat buffers, mixprec.optim.flat), as torch's fused optimizers
do with ``found_inf``. The host may read the flag later, for its counters and the LR schedule.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["StepInputs"]


@dataclass(frozen=True, kw_only=True)
class StepInputs:
    """The device tensors of one optimizer step."""

    found_inf: Tensor | None = None
    """0-dim float32 on the gradients' device, > 0 when a gradient of this step is inf/NaN (the
    scaler's agreed flag): the step then leaves parameters, masters and optimizer state bitwise
    as they were. ``None``: always step."""
