"""The 16-bit parameters family: the storage cast, the FP32 masters (none, full or split), the
Adam moments, and the loss scale of FP16 storage (``16-true``).

This is where ``recipe.masters`` chooses the optimizer: ``none`` with 16-bit parameters (updated
in place) -> torch's AdamW; otherwise the layout's class (:func:`_layout`: ``SplitMasterWeights``
for ``split``, ``MasterWeights`` for ``full`` and for FP32 parameters, which have no master),
around mixprec's AdamW (its moments) or around the user's torch optimizer. The class stores the
masters its way; nothing downstream decides the layout again."""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mixprec.errors import ConfigError
from mixprec.optim import AdamW, MasterWeights, SplitMasterWeights
from mixprec.precision.cast import cast_module
from mixprec.precision.plugins.base import Face, PrecisionPlugin

if TYPE_CHECKING:
    from mixprec.amp import GradScaler

__all__ = ["ParamsPlugin"]


class ParamsPlugin(PrecisionPlugin):
    """Stores parameters in the mode's dtype (the table's FP32 exemptions kept) and builds the
    optimizer around them. Every mode has one (``32-true`` casts nothing and keeps no masters)."""

    name = "params"

    def convert_module(self, precision: Face, model: nn.Module, *,
                       optimizer: torch.optim.Optimizer | None = None) -> nn.Module:
        """Storage dtypes, in place. ``optimizer``: one that already stored the parameters in 16
        bits (``fp16_params=True``); FP32-exempt ones get its exact FP32 masters back."""
        master_of = getattr(optimizer, "master_of", None)
        return cast_module(model, self.recipe.policy, dtype_for=precision.layers.param_dtype_for,
                           master_of=(lambda p: _master_or_none(master_of, p)) if master_of else None)

    def scale_loss(self, loss: torch.Tensor, scaler: GradScaler, *,
                   scale: float | None = None) -> torch.Tensor:
        """Scaled where the mode scales and stores parameters in 16 bits (``16-true``)."""
        if self.recipe.scales_loss and self.recipe.stores_low_precision:
            return scaler.scale(loss, value=scale)
        return loss

    def setup_optimizer(self, precision: Face, optimizer: torch.optim.Optimizer,
                        model: nn.Module) -> torch.optim.Optimizer:
        """The user's optimizer, wrapped in FP32 masters where the mode keeps them."""
        if isinstance(optimizer, MasterWeights) or not self.recipe.keeps_masters:
            return optimizer
        if optimizer.state:
            raise ConfigError(f"the {type(optimizer).__name__} has already stepped; call "
                              "precision.setup(model, optimizer) before training")
        accepted = inspect.signature(type(optimizer).__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])}
                  for g in optimizer.param_groups]
        precision.notes.append(f"{type(optimizer).__name__} steps FP32 master weights "
                               "(mixprec.optim.MasterWeights)")
        return MasterWeights(type(optimizer), groups, layout=_layout(self.recipe.masters),
                             master_params=precision.layers.master_params(model), **defaults)

    def make_optimizer(self, precision: Face, param_groups: list[dict[str, Any]], *,
                       model: nn.Module | None = None, **adamw_options: Any) -> torch.optim.Optimizer:
        """torch's AdamW for 16-bit parameters without masters (FP32 moments: the recipe refused
        others), else mixprec's AdamW in the recipe's master layout and moments; ``model``:
        masters exactly for the table's set."""
        recipe, notes = self.recipe, precision.notes
        if recipe.loses_small_updates:
            return torch.optim.AdamW(param_groups, **adamw_options)
        masters = precision.layers.master_params(model) if model is not None else None
        if _fuses(param_groups, masters, recipe.moments, recipe.keeps_masters, adamw_options):
            adamw_options = {**adamw_options, "fused": True}
            notes.append("AdamW: torch's fused kernel (fused=True, CUDA), which skips a non-finite "
                         "step on the device: no host read per step")
        opt = AdamW(param_groups, layout=_layout(recipe.masters), moments=recipe.moments,
                    master_params=masters, **adamw_options)
        if opt.split_count:       # said only where a BF16 parameter got one (not under 32-true)
            notes.append("FP32 masters of BF16 parameters split: the parameter + a 16-bit "
                         "remainder, no FP32 master gradients (bit-identical)")
        if recipe.moments != "fp32":
            notes.append(f"Adam moments stored in {recipe.moments}"
                         + ("" if recipe.moments == "bf16" else " with per-block scales (matrices; "
                            "vectors keep FP32 moments)") + ", widened to FP32 in the update "
                         "(moments; docs/lean.md)")
        return opt


def _layout(masters: str) -> type[MasterWeights]:
    """The class of the recipe's master layout: split wherever exact (the class's own rule) for
    ``split``; full FP32 masters for ``full`` (and ``none`` under 32-true: nothing to split)."""
    return SplitMasterWeights if masters == "split" else MasterWeights


def _fuses(param_groups: list[dict[str, Any]], masters: list[torch.Tensor] | None, moments: str,
           keeps_masters: bool, options: dict[str, Any]) -> bool:
    """Whether :meth:`ParamsPlugin.make_optimizer` makes its torch AdamW ``fused=True``: FP32
    moments, no separate master (by the table's set, or by the mode without one), every
    parameter on CUDA, and neither ``fused`` nor ``foreach`` chosen by the caller. Not on a CPU:
    there torch's fused kernel rounds differently from the foreach one (1 ulp), and a hand loop
    with torch's default AdamW must equal ``fit()``."""
    if moments != "fp32" or keeps_masters or masters or "fused" in options or "foreach" in options:
        return False
    params = [p for g in param_groups for p in g["params"]]
    return bool(params) and all(p.device.type == "cuda" and p.dtype == torch.float32 for p in params)


def _master_or_none(master_of: Callable[[torch.Tensor], torch.Tensor] | None,
                    p: torch.Tensor) -> torch.Tensor | None:
    if master_of is None:
        return None
    try:
        return master_of(p)
    except ConfigError:   # not one of the optimizer's parameters
        return None
