"""The checkpoint of :class:`mixprec.optim.MasterWeights`: the inner optimizer's state dict plus
the masters, in FP32, by flat param index (``sd[STATE_KEY] = {"dtype", "index", "tensors"}``).
Split masters are joined into FP32 tensors on save and split again on load, so files move between
the layouts; everything loads with ``torch.load(..., weights_only=True)``."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mixprec.errors import CheckpointError
from mixprec.optim.master_table import Masters

__all__ = ["STATE_KEY", "save", "load", "load_inner", "load_masters"]

STATE_KEY = "master_weights"
"""Where a ``MasterWeights`` state dict keeps its masters."""


def save(inner: torch.optim.Optimizer, master_dtype: torch.dtype, all_params: list[Tensor],
         model_params: list[Tensor], masters: list[Tensor]) -> dict[str, Any]:
    """``inner``'s state dict plus ``masters`` (those of ``model_params``, indexed in
    ``all_params``). Like torch's, the tensors are references, not copies."""
    sd = inner.state_dict()
    # The flat step's per-master state views share one step counter per chunk
    # (mixprec.optim.flat): save each its own, as torch's optimizers do.
    sd["state"] = {i: {k: (v.clone() if isinstance(v, torch.Tensor) and v.dim() == 0 else v)
                       for k, v in st.items()} for i, st in sd["state"].items()}
    index = {id(p): i for i, p in enumerate(all_params)}
    sd[STATE_KEY] = {"dtype": str(master_dtype).removeprefix("torch."),
                     "index": [index[id(p)] for p in model_params], "tensors": masters}
    return sd


def load(inner: torch.optim.Optimizer, table: Masters, state_dict: dict[str, Any]) -> None:
    """``state_dict`` into ``inner`` and, where it holds masters, into ``table``'s (a plain torch
    optimizer state dict has none: the masters stay as they are)."""
    sd = dict(state_dict)
    saved = sd.pop(STATE_KEY, None)
    load_inner(inner, sd)
    table.grads_ready = False
    if saved is not None:
        load_masters(saved, table.all_params, table.master_of, table.load_own)


def load_inner(inner: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    """The inner optimizer's part of ``sd`` (without ``STATE_KEY``), refused in one line when it
    does not fit."""
    try:
        inner.load_state_dict(sd)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"optimizer state does not match this optimizer ({exc}); load it into "
                              "an optimizer built over the same parameters in the same order") from None


@torch.no_grad()
def load_masters(saved: dict[str, Any], all_params: list[Tensor], master_of: dict[int, Tensor],
                 load_own: Callable[[Tensor, Tensor, Tensor], bool]) -> None:
    """Copy the saved masters into this optimizer's (``master_of``: id(param) -> master, the
    param itself when it is its own) and round them into the model params; ``load_own(p, m,
    saved)`` loads a master the layout stores its own way (True) or leaves it to the copy."""
    n = len(all_params)
    tensors, index = saved["tensors"], saved["index"]
    if len(tensors) != len(index) or any(not 0 <= i < n for i in index):
        raise CheckpointError("the saved master weights index params this optimizer does not have; "
                              "load the checkpoint into an optimizer over the same model")
    dst_masters, src, model_params = [], [], []
    for i, t in zip(index, tensors):
        p = all_params[i]
        if t.shape != p.shape:
            raise CheckpointError(f"saved master #{i} has shape {tuple(t.shape)} but the param has "
                                  f"{tuple(p.shape)}; load the checkpoint into the same model architecture")
        m = master_of[id(p)]
        if load_own(p, m, t):
            continue
        dst_masters.append(m)
        src.append(t)
        if m is not p:
            model_params.append(p)
    if not dst_masters:
        return
    torch._foreach_copy_(dst_masters, src)
    if model_params:
        torch._foreach_copy_(model_params, [master_of[id(p)] for p in model_params])
