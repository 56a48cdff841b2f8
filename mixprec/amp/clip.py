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

from collections.abc import Sequence

import torch
from torch import Tensor

from mixprec.amp.grad_norms import split_norms
from mixprec.amp.grad_scaler import GradScaler
from mixprec.amp.iteration import _Stage
from mixprec.amp.grads import HasMasterGrads
from mixprec.amp.unscale import deferred_grads, scale_grads_
from mixprec.errors import ConfigError

__all__ = ["clip_grad_norm_", "clip_grads_"]


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
    if deferred is None:
        return clip_grads_(optimizer, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite,
                           foreach=foreach)[0]
    # split masters: the norm of the FP32 values, the coefficient deferred
    total, coef = clip_grads_(optimizer, max_norm, norm_type, deferred.own, low=deferred.low,
                              order=[g for _, g in deferred.entries], factors=deferred.factors,
                              batches=deferred.batches, error_if_nonfinite=error_if_nonfinite,
                              foreach=foreach)
    if coef is not None:
        deferred.factors.append(coef)
    return total


@torch.no_grad()
def clip_grads_(optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0,
                grads: list[Tensor] | None = None, *, low: list[Tensor] | None = None,
                order: list[Tensor] | None = None, factors: Sequence[Tensor] = (),
                batches: list[tuple[list[int], list[Tensor]]] | None = None,
                error_if_nonfinite: bool = False, foreach: bool | None = None
                ) -> tuple[Tensor, Tensor | None]:
    """Clip already unscaled gradients the caller hands over (``mixprec.Precision.step``, which
    asked the optimizer for them): ``grads`` (its ``master_grads()``; None: the ``.grad`` of its
    ``param_groups``, DTensors whole) multiplied in place by the coefficient. With ``low`` (a
    split-master step's model-dtype gradients, ``order``: all in param-group order, ``factors``:
    theirs so far, ``batches``: the optimizer's scratch views) the norm spans their FP32 values
    and their coefficient is returned for the step to apply. Returns (the total norm before
    clipping, the coefficient on ``low``'s device; None without ``low``)."""
    max_norm = float(max_norm)
    if not max_norm > 0:
        raise ConfigError(f"max_norm must be > 0, not {max_norm}")
    if low is None:
        grads = _grads_for_clipping(optimizer) if grads is None else [g for g in grads if g is not None]
        if not grads:
            return torch.zeros(()), None
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)  # ()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)                                 # ()
        groups = torch._C._group_tensors_by_device_and_dtype([grads], False)
        for (device, _dtype), ([group], _) in groups.items():
            torch._foreach_mul_(group, coef.to(device))
        return total, None
    own = grads or []
    norms = split_norms(own, low, order if order is not None else own + low, factors, batches,
                        norm_type, foreach)
    if not norms:
        return torch.zeros(()), None
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so "
                           "it cannot be clipped; pass error_if_nonfinite=False to skip this check")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    scale_grads_(own, lambda device: coef.to(device))
    return total, (coef.to(low[0].device) if low else None)


def _grads_for_clipping(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """Like :func:`optimizer_grads` but keeps DTensor grads whole, so the norm spans all shards."""
    if isinstance(optimizer, HasMasterGrads):
        return [g for g in optimizer.master_grads() if g is not None]
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if any(g.is_sparse for g in grads):
        raise ConfigError("clip_grad_norm_ does not clip sparse gradients; clip their values yourself")
    return grads
