"""Applying storage dtypes: cast a module's parameters per the rule book.

:class:`mixprec.Precision` calls :func:`cast_module` with its per-layer decision
(``dtype_for``); without one, the rule book's FP32 exemptions under ``policy`` decide
(:func:`mixprec.precision.rules.keep_fp32_reason`).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mixprec.optim import registry
from mixprec.policy.policy import PRESETS, Policy
from mixprec.precision.rules import keep_fp32_reason

__all__ = ["cast_module", "mark_fp32_params"]

_F32 = torch.float32


def cast_module(module: nn.Module, policy: Policy, *,
                dtype_for: Callable[[str, nn.Module], torch.dtype] | None = None,
                master_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None) -> nn.Module:
    """Store ``module``'s floating parameters in ``policy.param_dtype``, in place.

    Modules the policy keeps in FP32 (the rule book: :func:`~mixprec.precision.rules.keep_fp32_reason`) keep FP32 parameters, which
    are tagged ``keep_in_fp32`` for optimizers (as :func:`mark_fp32_params` does). Buffers follow
    their module's parameters; buffers of parameter-free modules (rotary frequencies, masks) keep
    their dtype. ``dtype_for(qname, module)`` replaces the policy's choice per module
    (``mixprec.Precision`` passes its per-layer decision); ``master_of(param)`` returns an
    optimizer's FP32 master of a parameter it already stored in 16 bits, so an exempt parameter
    gets its exact FP32 value back. Returns ``module`` for chaining.
    """
    for qname, sub in module.named_modules():
        own = list(sub.parameters(recurse=False))
        if not own:
            continue
        if dtype_for is not None:
            target = dtype_for(qname, sub)
        else:
            target = _F32 if keep_fp32_reason(policy, qname, sub) is not None else policy.param_dtype
        for p in own:
            if target == _F32:
                p.keep_in_fp32 = True   # for user code; optimizers read the record below
                registry.keep_fp32([p])  # MasterWeights' fallback: no 16-bit copy, no extra master
            if p.is_floating_point() and p.dtype != target:
                master = master_of(p) if master_of is not None else None
                exact = master is not None and master.dtype == target
                p.data = master.detach().clone() if exact else p.data.to(target)
        for bname, b in list(sub.named_buffers(recurse=False)):
            if b is not None and b.is_floating_point() and b.dtype != target:
                setattr(sub, bname, b.to(target))
    return module


def mark_fp32_params(module: nn.Module, policy: Policy | None = None) -> nn.Module:
    """Tag the parameters of modules kept in FP32 with ``param.keep_in_fp32 = True``.

    Optimizers only see parameters, not modules: ``mixprec.optim.AdamW(model.parameters(),
    fp16_params=True)`` reads this record (``mixprec.optim.registry.kept_fp32``) to leave norm and gate parameters in FP32 while it stores
    the rest in 16 bits. ``policy`` defaults to the standard rules (norm types and modules with a
    truthy ``keep_in_fp32``). Returns ``module``.
    """
    policy = policy or PRESETS["32-true"]
    for qname, sub in module.named_modules():
        if keep_fp32_reason(policy, qname, sub) is not None:
            for p in sub.parameters(recurse=False):
                p.keep_in_fp32 = True
            registry.keep_fp32(sub.parameters(recurse=False))
    return module
