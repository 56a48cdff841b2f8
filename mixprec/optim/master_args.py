"""The arguments of :class:`mixprec.optim.MasterWeights` (and mixprec's AdamW) checked: the inner
optimizer's class, the dtypes, and the param groups as a list of group dicts."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from mixprec.errors import ConfigError
from mixprec.optim.master_table import Masters
from mixprec.optim.split import resolve_split

__all__ = ["normalise_groups", "check_master_args"]


def normalise_groups(params: Iterable[Tensor] | Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Turn the ``params`` argument of an optimizer into a list of group dicts (copies)."""
    if isinstance(params, Tensor):
        raise ConfigError("params must be an iterable of tensors or of param-group dicts, not a single "
                          "tensor; pass model.parameters() or [tensor]")
    groups = list(params)
    if not groups:
        raise ConfigError("the optimizer got an empty parameter list; pass model.parameters() of a model "
                          "that has parameters")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    out = []
    for group in groups:
        group = dict(group)
        ps = group["params"]
        group["params"] = [ps] if isinstance(ps, Tensor) else list(ps)
        out.append(group)
    return out


def check_master_args(optimizer_cls: Any, master_dtype: torch.dtype,
                      param_dtype: torch.dtype | None, *, split: bool | None = None,
                      layout: Any = None) -> None:
    """Refuse, with the fix, what ``MasterWeights(optimizer_cls, ..., master_dtype=...,
    param_dtype=..., split=..., layout=...)`` cannot do: among it a ``split`` flag that says
    otherwise than the ``layout`` class given with it (``split=False`` with the split layout, or
    ``split=True`` with the full one), and ``split=True`` where split masters cannot be exact."""
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise ConfigError(f"optimizer_cls must be a torch.optim.Optimizer subclass, got {optimizer_cls!r}; "
                          "pass e.g. torch.optim.AdamW (the class, not an instance)")
    if optimizer_cls is torch.optim.LBFGS:
        raise ConfigError("LBFGS re-evaluates its closure many times per step, which master weights "
                          "cannot follow; use LBFGS on FP32 params without MasterWeights")
    if not master_dtype.is_floating_point:
        raise ConfigError(f"master_dtype must be a floating-point dtype, got {master_dtype}; "
                          "use torch.float32")
    if param_dtype is not None and not param_dtype.is_floating_point:
        raise ConfigError(f"param_dtype must be a floating-point dtype, got {param_dtype}; "
                          "use torch.float16 or torch.bfloat16")
    if split is not None and layout is not None and split != (layout._table_cls is not Masters):
        raise ConfigError(f"split (split_masters)={split} and layout={layout.__name__} disagree; "
                          "give one of them")
    if split:
        resolve_split(split, optimizer_cls, master_dtype)
