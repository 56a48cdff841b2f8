"""Which gradients a step uses, and unscaling them fused with the inf/NaN check.

``optimizer_grads`` implements the grad protocol of docs/CONTRACTS.md (``master_grads()`` first,
else the ``.grad`` of ``param_groups``). ``check_and_unscale`` multiplies them by ``1/scale`` in
place and raises a 0-dim float32 ``found_inf`` flag, per (device, dtype) group, with
``torch._amp_foreach_non_finite_check_and_unscale_`` where that kernel takes the dtype, and with a
foreach fallback (``_foreach_mul_`` + ``_foreach_norm(inf)``) where it does not (BF16 on some CUDA
builds). Neither path synchronises with the host: reading the flag is the caller's single sync.
"""
from __future__ import annotations

import math
import operator
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mixprec.amp.grads import HasDeferredGrads, HasMasterGrads

__all__ = ["optimizer_grads", "deferred_grads", "check_and_unscale", "unscale_optimizer",
           "unscale_grads", "scale_grads_"]


def _dtensor_type() -> type | None:
    """DTensor's class if its module is loaded, else None: no tensor can be a DTensor before
    ``torch.distributed.tensor`` is imported, and importing it here would add about a second to
    every ``import mixprec`` (every CLI call, every torchrun worker)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


_LAYOUT = operator.attrgetter("layout")


def optimizer_grads(optimizer: torch.optim.Optimizer,
                    master_grads: list[Tensor] | None = None) -> list[Tensor]:
    """The gradient tensors ``optimizer`` will step with, as plain local tensors.

    Follows the grad protocol of docs/CONTRACTS.md: an optimizer with ``master_grads()`` (FP32
    masters) provides them (``master_grads``: what it returned, asked by the caller); otherwise
    the ``.grad`` of its ``param_groups``. Sparse grads give their values (FP16 ones coalesced
    first, as torch does), DTensor grads their local shard.
    """
    masters = master_grads is not None or isinstance(optimizer, HasMasterGrads)
    if masters:
        given = optimizer.master_grads() if master_grads is None else master_grads
        raw = [g for g in given if g is not None]
    else:
        raw = [g for group in optimizer.param_groups for p in group["params"]
               if (g := p.grad) is not None]
    # Fast path (the common case): plain dense tensors. map() keeps this check out of Python loops.
    if not raw or (set(map(type, raw)) <= {torch.Tensor} and set(map(_LAYOUT, raw)) == {torch.strided}):
        return raw
    if not masters:
        for group in optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is not None and g.is_sparse and g.dtype == torch.float16 and not g.is_coalesced():
                    p.grad = g.coalesce()   # summing duplicates later could overflow fp16
        raw = [g for group in optimizer.param_groups for p in group["params"]
               if (g := p.grad) is not None]
    dtensor = _dtensor_type()
    return [g._values() if g.is_sparse else
            g._local_tensor if dtensor is not None and isinstance(g, dtensor) else g
            for g in raw]


def deferred_grads(optimizer: torch.optim.Optimizer) -> Any:
    """The optimizer's :class:`mixprec.optim.split.DeferredGrads` (split FP32 masters: BF16
    gradients read by the step, unscale and clip factors applied inside it), or None: then use
    :func:`optimizer_grads`."""
    return optimizer.deferred_grads() if isinstance(optimizer, HasDeferredGrads) else None


_FUSED_OK: dict[tuple[str, torch.dtype], bool] = {}


def _fused_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's fused check-and-unscale kernel takes ``dtype`` on ``device`` (probed once)."""
    key = (device.type, dtype)
    ok = _FUSED_OK.get(key)
    if ok is None:
        probe = torch.ones(1, dtype=dtype, device=device)
        flag = torch.zeros((), dtype=torch.float32, device=device)
        try:
            torch._amp_foreach_non_finite_check_and_unscale_([probe], flag, torch.ones_like(flag))
            ok = True
        except (RuntimeError, NotImplementedError):
            ok = False
        _FUSED_OK[key] = ok
    return ok


def _unscale_group(grads: list[Tensor], inv_scale: Tensor | None, found_inf: Tensor) -> None:
    """Multiply ``grads`` (one device, one dtype) by ``inv_scale`` in place and raise
    ``found_inf`` to 1 if any element is inf/NaN. No host sync on either path. Without a scale
    (BF16/FP32 modes) the grads are only read: multiplying them by 1 would write them all."""
    if inv_scale is not None and _fused_supported(grads[0].device, grads[0].dtype):
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        return
    if inv_scale is not None:
        torch._foreach_mul_(grads, inv_scale)
    # The inf-norm propagates NaN and is inf for +-inf: non-finite iff some element is.
    norms = torch._foreach_norm(grads, math.inf)                       # len(grads) x ()
    bad = torch.stack(norms).isfinite().logical_not().any()            # ()
    found_inf.copy_(torch.maximum(found_inf, bad.to(found_inf.dtype)))


def check_and_unscale(grads: list[Tensor], inv_scale_for: Callable[[torch.device], Tensor | None],
                      home: torch.device | None) -> Tensor:
    """Unscale every group; return one 0-dim float32 flag (0 or 1) on ``home`` (or the first
    grad's device)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=home or "cpu")
    groups = torch._C._group_tensors_by_device_and_dtype([grads], False)
    flags: dict[torch.device, Tensor] = {}
    with torch.no_grad():
        for (device, _dtype), ([group], _) in groups.items():
            flag = flags.get(device)
            if flag is None:
                flag = flags[device] = torch.zeros((), dtype=torch.float32, device=device)
            _unscale_group(group, inv_scale_for(device), flag)
    home = home or grads[0].device
    found = None
    for flag in flags.values():
        # non_blocking only towards an accelerator: a host flag must be complete before .item()
        flag = flag.to(home, non_blocking=home.type != "cpu")
        # max, not a sum: the flag stays 0 or 1, what torch's fused optimizers take as found_inf
        # (they skip at exactly 1 and subtract it from their step counters).
        found = flag if found is None else torch.maximum(found, flag)
    return found


def unscale_optimizer(optimizer: torch.optim.Optimizer,
                      inv_scale_for: Callable[[torch.device], Tensor | None],
                      home: torch.device | None, process_group: Any = None) -> tuple[Tensor, bool]:
    """Unscale ``optimizer``'s gradients (its deferred ones for split masters: checked as they
    are, the factor handed to the step) and check them: the agreed 0-dim float32 flag (all-reduced
    with MAX over ``process_group`` under ``torch.distributed``) and whether it had no gradient."""
    deferred = deferred_grads(optimizer)
    if deferred is None:
        return unscale_grads(optimizer_grads(optimizer), inv_scale_for, home, process_group)
    # split masters: check the BF16 grads as they are, scale inside the step
    found = _check_split(deferred.low, deferred.own, home)
    deferred.scale_(inv_scale_for)
    return _agreed(found, process_group), not deferred.entries


def unscale_grads(grads: list[Tensor], inv_scale_for: Callable[[torch.device], Tensor | None],
                  home: torch.device | None, process_group: Any = None, *,
                  low: list[Tensor] | None = None) -> tuple[Tensor, bool]:
    """What :func:`unscale_optimizer` does, over gradients the caller asked the optimizer for
    (``mixprec.Precision.step``): ``grads`` unscaled in place and checked; ``low`` (split masters'
    model-dtype gradients, whose factor the step applies) checked as they are, ``grads`` then
    checked unscaled and multiplied, exactly as for the optimizer's deferred gradients. Returns
    the agreed flag and whether there was no gradient."""
    if low is None:
        found = check_and_unscale(grads, inv_scale_for, home)
    else:
        found = _check_split(low, grads, home)
        scale_grads_(grads, inv_scale_for)
    return _agreed(found, process_group), not grads and not low


def _check_split(low: list[Tensor], own: list[Tensor], home: torch.device | None) -> Tensor:
    found = check_and_unscale(low, lambda dev: None, home)
    return torch.maximum(found, check_and_unscale(own, lambda dev: None, home).to(found.device))


@torch.no_grad()
def scale_grads_(grads: list[Tensor], factor_for: Callable[[torch.device], Tensor | None]) -> None:
    """Multiply ``grads`` by ``factor_for(device)`` in place, one foreach per (device, dtype)."""
    groups = torch._C._group_tensors_by_device_and_dtype([grads], False) if grads else {}
    for (device, _dtype), ([group], _) in groups.items():
        f = factor_for(device)
        if f is not None:
            torch._foreach_mul_(group, f)


def _agreed(found: Tensor, process_group: Any) -> Tensor:
    pg = process_group
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size(pg) > 1:
        # Every rank must take the same skip decision, or their weights and scales diverge.
        torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX, group=pg)
    return found
