"""Gradient-norm clipping that cannot clip scaled gradients.

Clipping a still-scaled gradient compares ``scale * ||g||`` with ``max_norm``: with a scale of
65536 every step gets clipped to almost nothing. The usual fix is a convention ("call
``scaler.unscale_`` first"); here it is the function's job: :func:`clip_grad_norm_` unscales the
optimizer's gradients itself (exactly once — a later ``scaler.step`` will not unscale again), and
clips the gradients the optimizer will actually use (FP32 master grads for master-weight
optimizers, see docs/CONTRACTS.md).

No host sync: the norm stays a tensor and the clip coefficient is applied unconditionally
(``min(max_norm / (norm + 1e-6), 1)``), as in ``torch.nn.utils.clip_grad_norm_``. When a gradient
is inf/NaN the norm is too; the step is skipped by the scaler anyway.
"""
from __future__ import annotations

import torch
from torch import Tensor

from mixprec.amp.grad_scaler import GradScaler
from mixprec.amp.iteration import _Stage
from mixprec.amp.grads import HasMasterGrads
from mixprec.amp.unscale import deferred_grads
from mixprec.errors import ConfigError

__all__ = ["clip_grad_norm_"]


def _unscale_first(scaler: GradScaler | torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    if isinstance(scaler, GradScaler):
        stage = scaler._stage(optimizer)
        if stage is _Stage.STEPPED:
            raise RuntimeError("clip_grad_norm_ called after scaler.step(optimizer): the step has "
                               "already used the gradients; clip between backward() and step()")
        if stage is _Stage.READY:
            scaler.unscale_(optimizer)
        if scaler.grads_are_scaled(optimizer):   # defensive: never clip a scaled gradient
            raise RuntimeError("refusing to clip scaled gradients; call scaler.unscale_(optimizer)")
        return
    if isinstance(scaler, torch.amp.GradScaler):
        if not scaler.is_enabled():
            return
        stage = scaler._per_optimizer_states[id(optimizer)]["stage"].name
        if stage == "STEPPED":
            raise RuntimeError("clip_grad_norm_ called after scaler.step(optimizer); clip between "
                               "backward() and step()")
        if stage == "READY":
            scaler.unscale_(optimizer)
        return
    raise ConfigError(f"clip_grad_norm_ needs a mixprec.amp.GradScaler (or torch.amp.GradScaler) "
                      f"as its first argument, not {type(scaler).__name__}; pass the scaler that "
                      "scaled the loss")


@torch.no_grad()
def clip_grad_norm_(scaler: GradScaler | torch.amp.GradScaler, optimizer: torch.optim.Optimizer,
                     max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False,
                     foreach: bool | None = None) -> Tensor:
    """Unscale ``optimizer``'s gradients (once) and clip their total ``norm_type``-norm to
    ``max_norm`` in place. Returns the total norm of the *unscaled* gradients before clipping.

    Works with plain, master-weight (``master_grads()``) and DTensor gradients (the norm of DTensor
    grads is computed by torch across shards).
    """
    max_norm = float(max_norm)
    if not max_norm > 0:
        raise ConfigError(f"max_norm must be > 0, not {max_norm}")
    _unscale_first(scaler, optimizer)
    deferred = deferred_grads(optimizer)
    if deferred is not None:   # split masters: the norm of the FP32 values, the coefficient deferred
        norms = deferred.norms(norm_type, foreach)
        if not norms:
            return torch.zeros(())
        total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
        if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so "
                               "it cannot be clipped; pass error_if_nonfinite=False to skip this check")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        deferred.scale_(lambda device: coef.to(device))
        return total
    grads = _grads_for_clipping(optimizer)
    if not grads:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)   # ()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)                                  # ()
    groups = torch._C._group_tensors_by_device_and_dtype([grads], False)
    for (device, _dtype), ([group], _) in groups.items():
        torch._foreach_mul_(group, coef.to(device))
    return total


def _grads_for_clipping(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """Like :func:`optimizer_grads` but keeps DTensor grads whole, so the norm spans all shards."""
    if isinstance(optimizer, HasMasterGrads):
        return [g for g in optimizer.master_grads() if g is not None]
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if any(g.is_sparse for g in grads):
        raise ConfigError("clip_grad_norm_ does not clip sparse gradients; clip their values yourself")
    return grads
