"""The gradient norms of a step whose low-precision gradients are scaled inside the step.

Split FP32 masters (mixprec.optim.split_masters) keep no FP32 copy of a split parameter's
gradient: the step widens the model's BF16 gradient and multiplies it by pending factors (the
unscale factor, then the clip coefficient). Clipping needs the norms of those FP32 values before
the step: :func:`split_norms` computes them from the tensors alone (the BF16 gradients, the
factors so far, and optionally the optimizer's FP32 scratch views), so the scaler and the clip
never call into the optimizer for them. The numbers are ``torch.nn.utils.get_total_norm``'s.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils._foreach_utils import _device_has_foreach_support, _has_foreach_support

__all__ = ["CHUNK_NUMEL", "widen", "split_norms", "tensor_norms", "grouped_norms"]

CHUNK_NUMEL = 1 << 22  # 4 Mi elements: the FP32 widening costs at most 2 x 16 MiB at a time


@torch.no_grad()
def widen(grads: list[Tensor], factors: Sequence[Tensor]) -> list[Tensor]:
    """FP32 copies of ``grads`` multiplied by ``factors`` in order: the values today's FP32 master
    gradients hold after unscaling (one FP32 multiply) and clipping (another)."""
    out = [torch.empty_like(g, dtype=torch.float32) for g in grads]
    if out:
        torch._foreach_copy_(out, grads)
        for f in factors:
            torch._foreach_mul_(out, f.to(out[0].device))
    return out


@torch.no_grad()
def split_norms(own: list[Tensor], low: list[Tensor], order: list[Tensor], factors: Sequence[Tensor],
                batches: list[tuple[list[int], list[Tensor]]] | None, norm_type: float,
                foreach: bool | None = None) -> list[Tensor]:
    """Per-tensor ``norm_type``-norms of the FP32 gradients a split-master step will use, in the
    order ``torch.nn.utils.get_total_norm`` stacks them (grouped by device, first seen first).

    ``own``: FP32 gradients (already multiplied by every factor); ``low``: model-dtype gradients,
    widened here and multiplied by ``factors``; ``order``: all of them in param-group order.
    ``own`` gradients take one foreach norm per (device, dtype); ``low`` ones are widened one
    bounded batch at a time: into the optimizer's scratch views when it gave them (``batches``:
    per chunk, positions in ``low`` and FP32 views; a fixed number of ops whatever the number of
    tensors), else into fresh FP32 copies of at most ``CHUNK_NUMEL`` elements."""
    norm_of: dict[int, Tensor] = {}
    if own:
        for g, n in zip(own, grouped_norms(own, norm_type, foreach)):
            norm_of[id(g)] = n
    if batches is not None:
        for idx, views in batches:
            grads = [low[i] for i in idx]
            torch._foreach_copy_(views, grads)
            for f in factors:
                torch._foreach_mul_(views, f.to(views[0].device))
            for g, n in zip(grads, tensor_norms(views, norm_type, foreach)):
                norm_of[id(g)] = n
    else:
        pending: list[Tensor] = []
        budget = 0

        def flush() -> None:
            if pending:
                wide = widen(pending, factors)
                for g, n in zip(pending, tensor_norms(wide, norm_type, foreach)):
                    norm_of[id(g)] = n
                pending.clear()

        for g in low:
            if pending and budget + g.numel() > CHUNK_NUMEL:
                flush()
                budget = 0
            pending.append(g)
            budget += g.numel()
        flush()
    out = [(g.device, norm_of[id(g)]) for g in order]
    devices = list(dict.fromkeys(d for d, _ in out))
    return [n for dev in devices for d, n in out if d == dev]


def grouped_norms(tensors: list[Tensor], norm_type: float, foreach: bool | None) -> list[Tensor]:
    """:func:`tensor_norms` per (device, dtype) group, returned in the order of ``tensors``."""
    groups = torch._C._group_tensors_by_device_and_dtype([tensors], True)
    out: list[Tensor | None] = [None] * len(tensors)
    for ([group], indices) in groups.values():
        for i, n in zip(indices, tensor_norms(group, norm_type, foreach)):
            out[i] = n
    return out  # type: ignore[return-value]


def tensor_norms(tensors: list[Tensor], norm_type: float, foreach: bool | None) -> list[Tensor]:
    """The per-tensor norms exactly as ``torch.nn.utils.get_total_norm`` computes them."""
    device = tensors[0].device
    if (foreach is None and _has_foreach_support(tensors, device)) or (
            foreach and _device_has_foreach_support(device)):
        return list(torch._foreach_norm(tensors, norm_type))
    return [torch.linalg.vector_norm(g, norm_type) for g in tensors]
