"""The per-layer formats family: FP8 and micro-format (MXFP8, MXFP4, NVFP4) Linears, and Linears
whose 16/32-bit format differs from the surrounding one.

The cut: one plugin for FP8 and micro formats together, because their module conversion is one
walk (:func:`mixprec.precision.layers.apply_formats`, behind ``Precision.layers.apply``)
that asks each Linear its format once and swaps it to ``Fp8Linear``, ``MicroLinear`` or
``FormatLinear``, with one eligibility function and one report type (#38, item 3). Two plugins
would walk the model twice and split a per-layer plan that mixes FP8, NVFP4 and FP32 layers."""
from __future__ import annotations

import torch
from torch import nn

from mixprec.precision.plugins.base import Face, PrecisionPlugin

__all__ = ["FormatsPlugin"]


class FormatsPlugin(PrecisionPlugin):
    """Swaps every Linear to the module its format needs (after the storage cast: the swapped
    layers reuse the cast Parameters). Asked in every mode: a ``32-true`` run with a plan has
    per-layer formats too. The formats' scaling state (delayed-scaling amax histories) lives in
    the swapped modules, so it travels with the model's state dict, not here."""

    name = "formats"

    def convert_module(self, precision: Face, model: nn.Module, *,
                       optimizer: torch.optim.Optimizer | None = None) -> nn.Module:
        precision.layers.apply(model)
        return model
