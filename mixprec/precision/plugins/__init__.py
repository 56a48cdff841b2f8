"""Small plugins that apply a :class:`~mixprec.precision.recipe.Recipe`, one per family, and
:func:`plugins_for`, which composes them.

=====================  ===========================================================  =========
family                 decides                                                      plugin
=====================  ===========================================================  =========
autocast modes         the forward's context and output dtype; FP16-compute scale   :class:`AutocastPlugin`
16-bit parameters      the storage cast; masters none/full/split and the moments;   :class:`ParamsPlugin`
                       FP16-storage scale
FP8 and micro formats  each Linear's module (``Fp8Linear``, ``MicroLinear``, ...)   :class:`FormatsPlugin`
FSDP2                  cast before sharding or not, the optimizer on the FP32       :class:`Fsdp2Plugin`
                       shards, the units' ``MixedPrecisionPolicy``
=====================  ===========================================================  =========

Each answers the hooks of :class:`PrecisionPlugin`; :class:`mixprec.Precision` is the face that
calls them (and runs the step itself, the same for every family)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mixprec.precision.plugins.autocast import AutocastPlugin
from mixprec.precision.plugins.base import PrecisionPlugin
from mixprec.precision.plugins.formats import FormatsPlugin
from mixprec.precision.plugins.fsdp2 import Fsdp2Plugin
from mixprec.precision.plugins.params import ParamsPlugin

if TYPE_CHECKING:
    from mixprec.amp import GradScaler
    from mixprec.precision.recipe import Recipe

__all__ = ["PrecisionPlugin", "AutocastPlugin", "ParamsPlugin", "FormatsPlugin", "Fsdp2Plugin",
           "Plugins", "plugins_for"]


@dataclass(frozen=True)
class Plugins:
    """The plugins applying one recipe, and which of them answers each hook."""

    autocast: AutocastPlugin
    params: ParamsPlugin
    formats: FormatsPlugin
    fsdp2: Fsdp2Plugin

    def converting(self, *, sharded: bool = False) -> tuple[PrecisionPlugin, ...]:
        """Who converts the module, in order: storage (FSDP2's when sharded), then the formats
        (whose swapped layers reuse the cast Parameters)."""
        return (self.fsdp2 if sharded else self.params, self.formats)

    def optimizing(self, *, sharded: bool = False) -> PrecisionPlugin:
        """Who builds or wraps the optimizer."""
        return self.fsdp2 if sharded else self.params

    def forward_context(self, device_type: str) -> contextlib.AbstractContextManager:
        return self.autocast.forward_context(device_type)

    def convert_output(self, x: Any) -> Any:
        return self.autocast.convert_output(x)

    def scale_loss(self, loss: torch.Tensor, scaler: GradScaler, *,
                   scale: float | None = None) -> torch.Tensor:
        """Scaled by the one family that scales (FP16 compute: autocast; FP16 storage: params)."""
        for plugin in (self.autocast, self.params):
            loss = plugin.scale_loss(loss, scaler, scale=scale)
        return loss


def plugins_for(recipe: Recipe) -> Plugins:
    """The plugins that apply ``recipe`` (each reads only the recipe; a family with nothing to do
    for it answers its hooks with "nothing")."""
    return Plugins(autocast=AutocastPlugin(recipe), params=ParamsPlugin(recipe),
                   formats=FormatsPlugin(recipe), fsdp2=Fsdp2Plugin(recipe))
