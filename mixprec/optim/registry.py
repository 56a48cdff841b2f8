"""Which mixprec optimizer was built for which parameters.

The source article on hardware cost (docs/sources.md) builds ``optimizer =
mp.optim.AdamW(model.parameters(), ...)`` inside ``strategy.scope()`` and then calls
``model.fit(loader, ...)`` without passing it. Rather than silently training with a different
optimizer, ``fit`` asks :func:`find_optimizer_for` for the mixprec optimizer whose parameters are
exactly the model's, and uses it.

It also holds the decider's record of parameters kept FP32 (:func:`keep_fp32`, written by
``mixprec.precision.cast_module`` / ``mark_fp32_params`` from the per-layer table's FP32 islands):
the fallback :class:`~mixprec.optim.MasterWeights` uses when it is not given the set of
parameters that need masters. The optimizer never reads attributes off parameters.
"""
from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["remember", "find_optimizer_for", "keep_fp32", "kept_fp32"]

_CREATED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_SERIAL = itertools.count()
_KEPT_FP32: WeakIdKeyDictionary = WeakIdKeyDictionary()   # param -> True (weak: dies with it)


def keep_fp32(params: Iterable[torch.Tensor]) -> None:
    """Record that the decider keeps ``params`` in FP32 (an FP32 island of the per-layer table)."""
    for p in params:
        _KEPT_FP32[p] = True


def kept_fp32(param: torch.Tensor) -> bool:
    """Whether the decider recorded ``param`` as kept in FP32."""
    return param in _KEPT_FP32


def remember(optimizer: torch.optim.Optimizer, model_params: Iterable[torch.Tensor]) -> None:
    """Record that ``optimizer`` updates exactly ``model_params``."""
    optimizer._mixprec_param_ids = frozenset(id(p) for p in model_params)  # type: ignore[attr-defined]
    optimizer._mixprec_serial = next(_SERIAL)  # type: ignore[attr-defined]
    _CREATED.add(optimizer)


def find_optimizer_for(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer | None:
    """The most recently built live mixprec optimizer over exactly ``params`` (trainable ones)."""
    wanted = frozenset(id(p) for p in params if p.requires_grad)
    found = None
    for opt in list(_CREATED):
        if getattr(opt, "_mixprec_param_ids", None) == wanted:
            if found is None or opt._mixprec_serial > found._mixprec_serial:
                found = opt
    return found
