"""The hooks a precision plugin answers, and what a plugin that has nothing to say returns.

One plugin per family (autocast, 16-bit parameters and their masters, FP8 and micro formats,
FSDP2) overrides the hooks its family decides; :func:`mixprec.precision.plugins.plugins_for`
composes them for a recipe and :class:`mixprec.Precision` calls the composition. The six hooks,
in the order a run meets them:

==================  ==========================================================================
hook                what it does
==================  ==========================================================================
convert_module      changes the model in place before training (storage dtypes, format swaps)
forward_context     the context the forward runs in; ``convert_output`` casts what it returns
scale_loss          the loss ``backward`` is called on (multiplied by the loss scale, or not)
optimizer           ``setup_optimizer`` wraps the user's optimizer, ``make_optimizer`` builds the
                    default one; None: not this plugin's to build
sharding policy     ``mixed_precision`` / ``island_policy``: FSDP2's per-unit dtypes, or None
state               ``state_dict`` / ``load_state_dict``: what a checkpoint must carry
==================  ==========================================================================

The step itself (unscale, clip, the non-finite check, the optimizer step, the scale update) is
not a hook: it is :meth:`mixprec.Precision.step`, top to bottom, the same for every family.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from mixprec.amp import GradScaler
    from mixprec.precision.layers import Layers
    from mixprec.precision.recipe import Recipe

__all__ = ["PrecisionPlugin", "Face"]


class Face(Protocol):
    """What the plugins read of :class:`mixprec.Precision`, which calls them (so they do not import
    it back): the per-layer decisions and the run log."""

    notes: list[str]
    layers: Layers
    """Every per-layer question (``param_dtype_for``, ``master_params``, ``apply``, the live
    ``formats``): :class:`~mixprec.precision.layers.Layers`."""


class PrecisionPlugin:
    """A family's part of applying a :class:`~mixprec.precision.recipe.Recipe`. Each hook's
    default is "nothing to do here"; a plugin overrides the hooks its family decides.

    Hooks that need the per-layer decisions (which parameters stay FP32, which get masters, each
    Linear's format) are handed the :class:`~mixprec.Precision` applying them and read them from
    it; the plugin keeps no state of the model."""

    name = "base"
    """The family's name (``mixprec.Precision.describe`` and error messages use it)."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.recipe.name!r})"

    # 1. convert the module
    def convert_module(self, precision: Face, model: nn.Module, *,
                       optimizer: torch.optim.Optimizer | None = None) -> nn.Module:
        """Change ``model`` in place for this family; return it."""
        return model

    # 2. the forward
    def forward_context(self, device_type: str) -> contextlib.AbstractContextManager:
        """The context the forward runs in."""
        return contextlib.nullcontext()

    def convert_output(self, x: Any) -> Any:
        """What the forward returns, as the caller should see it."""
        return x

    # 3. backward: the loss scale
    def scale_loss(self, loss: torch.Tensor, scaler: GradScaler, *,
                   scale: float | None = None) -> torch.Tensor:
        """The tensor ``backward`` is called on."""
        return loss

    # 4. the optimizer
    def setup_optimizer(self, precision: Face, optimizer: torch.optim.Optimizer,
                        model: nn.Module) -> torch.optim.Optimizer | None:
        """``optimizer`` (built, never stepped) as this family steps it; None: not this family's."""
        return None

    def make_optimizer(self, precision: Face, param_groups: list[dict[str, Any]], *,
                       model: nn.Module | None = None, **adamw_options: Any) -> torch.optim.Optimizer | None:
        """The default AdamW over ``param_groups`` for this family; None: not this family's."""
        return None

    # 5. the sharding policy
    def mixed_precision(self) -> Any:
        """FSDP2's ``MixedPrecisionPolicy`` for the ordinary units; None: not this family's."""
        return None

    def island_policy(self) -> Any:
        """FSDP2's policy for the units kept in FP32, or None."""
        return None

    # 6. state
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint carries for this family (nothing, unless overridden)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
