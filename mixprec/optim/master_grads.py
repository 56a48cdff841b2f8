"""The FP32 gradients of full masters: copied from the model params' low-precision grads once per
step (one foreach cast-copy per (device, dtype) bucket, into buffers allocated once per master),
and cleared. Split masters keep no FP32 gradient: the step reads the model's own grad
(mixprec.optim.split_masters)."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd.profiler import record_function

from mixprec.errors import ConfigError

__all__ = ["copy_grads", "zero_grads"]


@torch.no_grad()
def copy_grads(model_params: list[Tensor], masters: list[Tensor], buffers: dict[int, Tensor],
               reads_model_grad: Callable[[Tensor], bool]
               ) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Copy the grads of ``model_params`` into their ``masters``' FP32 ``.grad`` (``buffers``:
    id(master) -> its grad buffer, made here once); a master without a model grad gets none.
    Returns the (model params, masters) the step reads, and the masters whose model grad the step
    reads itself (``reads_model_grad``: no copy made)."""
    src, dst, stepped_params, stepped_masters, deferred = [], [], [], [], []
    for p, m in zip(model_params, masters):
        if p.grad is None:
            m.grad = None
            continue
        if p.grad.is_sparse:
            raise ConfigError("sparse gradients are not supported with master weights; "
                              "use a dense embedding (sparse=False)")
        stepped_params.append(p)
        stepped_masters.append(m)
        if reads_model_grad(m):
            deferred.append(m)
            continue
        if m.grad is None or m.grad.shape != m.shape:
            buf = buffers.get(id(m))
            if buf is None or buf.shape != m.shape:    # once, not per step: no per-master op
                buf = buffers[id(m)] = torch.empty_like(m)
            storage = buf.untyped_storage()
            if storage.nbytes() == 0:                  # freed by zero_grad(set_to_none=True)
                storage.resize_(buf.numel() * buf.element_size())
            m.grad = buf
        src.append(p.grad)
        dst.append(m.grad)
    if dst:
        with record_function("mixprec.master_grad_copy"):
            torch._foreach_copy_(dst, src)  # one cast-copy launch per (device, dtype) bucket
    return stepped_params, stepped_masters, deferred


def zero_grads(tensors: list[Tensor], buffers: dict[int, Tensor], set_to_none: bool) -> None:
    """``zero_grad`` of the model params and masters in ``tensors``: ``None`` (the FP32 grad
    ``buffers`` keep their tensors but free their memory until the next step), or zeros."""
    if set_to_none:
        for t in tensors:
            t.grad = None
        for buf in buffers.values():   # FP32 master grads hold no memory between steps
            buf.untyped_storage().resize_(0)
        return
    grads = [t.grad for t in tensors if t.grad is not None]
    for t in tensors:
        if t.grad is not None and t.grad.grad_fn is not None:
            t.grad = t.grad.detach()
    if grads:
        with torch.no_grad():
            torch._foreach_zero_(grads)
