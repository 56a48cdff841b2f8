"""Replace a layer by its mixed-precision counterpart without losing what the user attached to it.

FP8 conversion and per-layer formats swap an ``nn.Linear`` for an ``Fp8Linear`` or a
``FormatLinear`` that shares its Parameters. A forward or backward hook the user registered on the
original layer (activation capture, a monitor, an adapter) must keep running on the layer that
replaces it, and its handle must still remove it: the new module takes over the original's hook
dictionaries themselves, which is what the handles point at.
"""
from __future__ import annotations

from torch import nn

__all__ = ["replace_module"]


def _hook_attributes(module: nn.Module) -> list[str]:
    """The names of ``module``'s hook dictionaries (``_forward_hooks``, ``_backward_pre_hooks``,
    ``_state_dict_hooks``, ...) and the flag that says which kind of backward hook it holds."""
    return [k for k, v in vars(module).items()
            if (k.startswith("_") and "hooks" in k and isinstance(v, dict)) or k == "_is_full_backward_hook"]


def replace_module(parent: nn.Module, child: str, new: nn.Module) -> nn.Module:
    """``setattr(parent, child, new)``, carrying the replaced module's hooks over to ``new``."""
    old = getattr(parent, child)
    for name in _hook_attributes(old):
        setattr(new, name, getattr(old, name))
    setattr(parent, child, new)
    return new
