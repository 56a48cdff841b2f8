"""Which mixprec optimizer was built for which parameters.

The source article on hardware cost (docs/sources.md) builds ``optimizer =
mp.optim.AdamW(model.parameters(), ...)`` inside ``strategy.scope()`` and then calls
``model.fit(loader, ...)`` without passing it. Rather than silently training with a different
optimizer, ``fit`` asks :func:`find_optimizer_for` for the mixprec optimizer whose parameters are
exactly the model's, and uses it.
"""
from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable

import torch

__all__ = ["remember", "find_optimizer_for"]

_CREATED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_SERIAL = itertools.count()


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
