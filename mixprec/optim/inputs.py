"""What the precision side hands an optimizer step, declared in one place.

Why a type: the scaler and the clip used to find an optimizer's gradients by probing for
methods (``master_grads``, ``deferred_grads``) and decided on the host whether to call ``step()``
at all, reading the non-finite flag first (a host sync per step on an accelerator). A mixprec
master-weight optimizer takes the decision itself, on the device: ``step(inputs=StepInputs(...))``
with the flag as a device tensor issues the whole update and keeps the old values where the flag
is raised (``torch.where`` on its flat buffers, mixprec.optim.flat_skip), as torch's fused optimizers
do with ``found_inf``. The host may read the flag later, for its counters and the LR schedule.

torch's own fused optimizers take the same flag their way (an attribute, :func:`step_skipping_on_device`);
:func:`skips_on_device` says which can.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["StepInputs", "takes_found_inf", "skips_on_device", "step_skipping_on_device"]


@dataclass(frozen=True, kw_only=True)
class StepInputs:
    """The device tensors of one optimizer step."""

    found_inf: Tensor | None = None
    """0-dim float32 on the gradients' device, > 0 when a gradient of this step is inf/NaN (the
    scaler's agreed flag): the step then leaves parameters, masters and optimizer state bitwise
    as they were. ``None``: always step."""

    inv_scale: Tensor | None = None
    """0-dim float32: the unscale factor (1/scale) of the gradients the optimizer deferred
    (``deferred_grads()``: split masters' model-dtype gradients, which the scaler only checked),
    applied inside the step, first; a snapshot, which a later scale update cannot change.
    ``None``: nothing to unscale."""

    clip_coef: Tensor | None = None
    """0-dim float32: the clip coefficient of those deferred gradients, applied after
    ``inv_scale``. ``None``: no clipping (or measuring) this step."""

    @property
    def grad_factors(self) -> list[Tensor]:
        """The factors of the deferred gradients, in the order the step applies them."""
        return [f for f in (self.inv_scale, self.clip_coef) if f is not None]


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is one of torch's own that skip on the device: ``fused=True`` Adam,
    AdamW, SGD, Adagrad (torch's ``_step_supports_amp_scaling``). torch's ``GradScaler.step``
    hands them the flag as the attribute ``found_inf`` and never reads it: their fused kernel
    leaves parameters and state untouched where it is 1, and their step counters are stepped
    back by it. Every group must still say ``fused``: ``load_state_dict`` puts back the saved
    groups' ``fused`` (a checkpoint of a foreach run), and torch's non-fused step refuses the flag."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and \
        all(g.get("fused") for g in optimizer.param_groups)


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """:func:`takes_found_inf`, and every parameter with a gradient has its state already: a
    skipped *first* step must create no state (the meaning of a step not taken, and what a
    checkpoint holds), which torch's fused step would (zero moments, step 0), so the first step
    is decided on the host."""
    if not takes_found_inf(optimizer):
        return False
    state = optimizer.state
    return all(p in state for group in optimizer.param_groups for p in group["params"]
               if p.grad is not None)


def step_skipping_on_device(optimizer: torch.optim.Optimizer, found_inf: Tensor) -> Any:
    """``optimizer.step()`` of a :func:`takes_found_inf` optimizer with ``found_inf`` (0-dim
    float32, exactly 0 or 1, mixprec.amp.unscale) handed over as torch's ``GradScaler.step`` does:
    as an attribute for the step, deleted after it. The gradients are already unscaled (no
    ``grad_scale`` is handed over)."""
    optimizer.found_inf = found_inf          # type: ignore[attr-defined]
    try:
        return optimizer.step()
    finally:
        del optimizer.found_inf              # type: ignore[attr-defined]
