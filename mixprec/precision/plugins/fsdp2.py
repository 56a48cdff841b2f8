"""The FSDP2 family: what changes when ``fully_shard`` holds the parameters.

FSDP2 keeps the FP32 parameter shards and gathers each unit in its ``MixedPrecisionPolicy``'s
dtype: the FP32 shards are the masters (4 bytes per parameter / world, what split masters' BF16
parameter + 16-bit remainder also cost), so a mode with masters casts nothing before sharding and
its optimizer steps the shards directly. ``mixprec.strategies.FSDPStrategy`` asks this plugin for
the unit policies and the islands' policy; ``Precision.setup_module(sharded=True)`` and
``Precision.make_optimizer(sharded=True)`` use it instead of :class:`~.params.ParamsPlugin`."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mixprec.optim.adamw import sharded_adamw
from mixprec.precision.plugins.base import Face, PrecisionPlugin
from mixprec.precision.plugins.params import ParamsPlugin

__all__ = ["Fsdp2Plugin"]

_F32 = torch.float32

NO_SPLIT = ("split masters: nothing to split under FSDP2, whose FP32 parameter shards are the "
            "masters (4 bytes per parameter / world, what split masters' BF16 parameter + 16-bit "
            "remainder also cost) and whose BF16 copies exist only while a layer is gathered")
"""Why ``split_masters`` has no effect under FSDP2 (docs/lean.md), recorded in ``Precision.notes``."""


def _policy(**dtypes: torch.dtype | None):
    """FSDP2's ``MixedPrecisionPolicy(**dtypes)``."""
    # Function-level: torch.distributed.fsdp loads ~600 modules (~0.7 s), only where FSDP2 runs.
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(**dtypes)


class Fsdp2Plugin(PrecisionPlugin):
    """Storage, optimizer and unit policies of a model FSDP2 shards."""

    name = "fsdp2"

    @property
    def casts_before_sharding(self) -> bool:
        """Only a mode without masters casts the model to its 16-bit storage before sharding
        (with masters, the FP32 shards are the masters)."""
        return self.recipe.loses_small_updates

    def convert_module(self, precision: Face, model: nn.Module, *,
                       optimizer: torch.optim.Optimizer | None = None) -> nn.Module:
        if self.casts_before_sharding:
            return ParamsPlugin(self.recipe).convert_module(precision, model, optimizer=optimizer)
        return model

    def setup_optimizer(self, precision: Face, optimizer: torch.optim.Optimizer,
                        model: nn.Module) -> torch.optim.Optimizer:
        """The user's optimizer as it is: it steps the FP32 shards, which are the masters."""
        return optimizer

    def make_optimizer(self, precision: Face, param_groups: list[dict[str, Any]], *,
                       model: nn.Module | None = None, **adamw_options: Any) -> torch.optim.Optimizer:
        """torch's AdamW on the shards (FP32 moments), or mixprec's FP32-math AdamW for 16-bit
        or 8-bit moments, sharded and resharded with the parameters."""
        recipe = self.recipe
        if recipe.split_masters and recipe.keeps_masters:
            precision.notes.append(NO_SPLIT)
        if recipe.moments == "fp32":
            return torch.optim.AdamW(param_groups, **adamw_options)
        precision.notes.append(f"FSDP2: mixprec's FP32-math AdamW steps the FP32 shards with moments="
                               f"{recipe.moments}" + (" (matrices; vectors keep FP32 moments), sharded and "
                                                      "resharded with the parameters"
                                                      if recipe.moments != "bf16" else ""))
        return sharded_adamw(param_groups, moments=recipe.moments, **adamw_options)

    def mixed_precision(self):
        """``MixedPrecisionPolicy`` of the ordinary units: gathered in the compute dtype under
        autocast modes, in the storage dtype otherwise; gradients reduced in the reduce dtype."""
        r = self.recipe
        gather = r.compute_dtype if r.autocasts else r.param_dtype
        if gather == _F32:
            return _policy(reduce_dtype=None if r.reduce_dtype == _F32 else r.reduce_dtype)
        return _policy(param_dtype=gather, reduce_dtype=r.reduce_dtype)

    def island_policy(self):
        """The policy of units kept in FP32 (norms, gates), or None when every unit gathers FP32
        anyway: parameters FP32, output cast back to the gather dtype."""
        gather = self.mixed_precision().param_dtype
        if gather is None:
            return None
        return _policy(param_dtype=_F32, reduce_dtype=_F32, output_dtype=gather)
