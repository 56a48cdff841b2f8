"""Opt-in activation clamping: a counted safety net, never a default.

The source article on loss scaling (docs/sources.md) inserts ``torch.clamp(x, -64, 64)`` after
every ReLU and calls the effect on accuracy negligible. A fixed bound of 64 silently rewrites any
activation that legitimately exceeds it, and nobody learns how often it happened. Here clamping is:

* **opt-in**: nothing in mixprec installs it unless you call :func:`clamp_activations`;
* **bounded by the format, not by a guess**: the default bound is half the FP16 finite range
  (``65504 / 2 = 32752``), so an activation that passed the clamp can still be added to a residual
  of the same size, or multiplied by a weight slightly above one, without overflowing FP16;
* **counted**: every hooked module counts how many values it clamped (kept as device tensors, so
  counting adds no host sync; reading :attr:`ClampHandle.counts` syncs once);
* **removable**: :meth:`ClampHandle.remove` (or leaving the ``with`` block) restores the model.

Gradients: ``torch.clamp`` passes no gradient to clamped elements (their derivative is zero), so
a model that clamps often will learn slowly through those units — watch the counts. NaN is not a
range problem and passes through unchanged; the numerics monitor, not a clamp, should find it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mixprec.errors import ConfigError
from mixprec.policy.dtypes import format_info

__all__ = ["clamp_activations", "ClampHandle", "DEFAULT_CLAMP_BOUND"]

DEFAULT_CLAMP_BOUND: float = format_info(torch.float16).max / 2
"""Half the largest finite FP16 value (32752): headroom for one more add of equal magnitude."""

ModuleFilter = Callable[[str, nn.Module], bool]


def _default_filter(name: str, module: nn.Module) -> bool:
    return isinstance(module, nn.Linear)


class ClampHandle:
    """What :func:`clamp_activations` returns: per-module clamp counts and ``remove()``."""

    def __init__(self, bound: float) -> None:
        self.bound = bound
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._counts: dict[str, torch.Tensor] = {}

    @property
    def module_names(self) -> list[str]:
        """Qualified names of the hooked modules."""
        return list(self._counts)

    @property
    def counts(self) -> dict[str, int]:
        """Values clamped so far, per hooked module (one host sync for all of them)."""
        if not self._counts:
            return {}
        values = torch.stack([c.cpu() for c in self._counts.values()]).tolist()
        return dict(zip(self._counts, values))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def reset(self) -> None:
        for c in self._counts.values():
            c.zero_()

    def remove(self) -> None:
        """Unhook every module; counts stay readable."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def __enter__(self) -> "ClampHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _hook_for(self, name: str) -> Callable:
        bound = self.bound

        def hook(module: nn.Module, args, output):
            if not isinstance(output, torch.Tensor) or not output.is_floating_point():
                return output
            counter = self._counts[name]
            if counter.device != output.device:
                counter = self._counts[name] = counter.to(output.device)
            with torch.no_grad():
                counter += (output.abs() > bound).sum()
            return output.clamp(-bound, bound)

        return hook


def clamp_activations(model: nn.Module, bound: float | None = None,
                      module_filter_fn: ModuleFilter | None = None) -> ClampHandle:
    """Clamp the outputs of chosen modules of ``model`` into ``[-bound, bound]`` and count clamps.

    ``bound`` defaults to :data:`DEFAULT_CLAMP_BOUND` (half the FP16 range). ``module_filter_fn(name,
    module) -> bool`` chooses the modules (default: every ``nn.Linear``). Returns a
    :class:`ClampHandle`; call ``handle.remove()`` (or use it as a context manager) to undo.
    """
    bound = DEFAULT_CLAMP_BOUND if bound is None else float(bound)
    if not bound > 0 or bound == float("inf"):
        raise ConfigError(f"clamp bound must be a finite positive number, got {bound}")
    keep = module_filter_fn or _default_filter
    handle = ClampHandle(bound)
    for name, module in model.named_modules():
        if keep(name, module):
            device = next(module.parameters(), torch.empty(0)).device
            handle._counts[name] = torch.zeros((), dtype=torch.int64, device=device)
            handle._hooks.append(module.register_forward_hook(handle._hook_for(name)))
    if not handle._hooks:
        raise ConfigError("clamp_activations matched no module; pass a module_filter_fn that "
                          "returns True for the modules to clamp (default: nn.Linear)")
    return handle
