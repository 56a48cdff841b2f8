"""The per-master step of :class:`mixprec.optim.MasterWeights`: the inner optimizer over the
masters themselves (whole, or over the masters of one part of the model params at a time), then
the copy-back into the model params. The reference the flat step (mixprec.optim.flat) is
bit-identical to, and the fallback for what the flat step cannot do (flat's docstring)."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.autograd.profiler import record_function

from mixprec.optim import inputs as _inputs
from mixprec.optim.parts import restricted_groups

__all__ = ["step_whole", "step_parts"]

Around = Callable[[int], contextlib.AbstractContextManager]


def step_whole(inner: torch.optim.Optimizer, params: list[Tensor], masters: list[Tensor],
               found_on_device: Tensor | None) -> None:
    """One inner step over every master, then ``masters`` rounded into their model ``params``.
    ``found_on_device``: the inner optimizer (torch's ``fused=True``) skips on the device."""
    if found_on_device is not None:   # skipped: masters unchanged, so the copy-back rewrites the same bits
        _inputs.step_skipping_on_device(inner, found_on_device)
    else:
        inner.step()
    if params:
        with torch.no_grad(), record_function("mixprec.master_copy_back"):
            torch._foreach_copy_(params, masters)  # round-to-nearest into the model dtype


def step_parts(inner: torch.optim.Optimizer, parts: Sequence[Sequence[Tensor]],
               around: Around | None, master_of: dict[int, Tensor], stepped: set[int]) -> None:
    """The inner optimizer over each part's masters in turn (a view of its param groups, the
    state shared), each part's copy-back right after it, inside ``around(i)``; ``stepped``: ids of
    the model params with a grad this step."""
    whole = inner.param_groups
    try:
        for i, part in enumerate(parts):
            masters = [master_of[id(p)] for p in part]
            with (around(i) if around is not None else contextlib.nullcontext()):
                inner.param_groups = restricted_groups(whole, masters)
                inner.step()
                back = [p for p in part if id(p) in stepped and master_of[id(p)] is not p]
                if back:
                    with torch.no_grad(), record_function("mixprec.master_copy_back"):
                        torch._foreach_copy_(back, [master_of[id(p)] for p in back])
    finally:
        inner.param_groups = whole
