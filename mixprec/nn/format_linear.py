"""``FormatLinear``: an ``nn.Linear`` whose GEMM runs in a format of its own (per-layer precision).

:class:`mixprec.Precision` swaps a Linear for one of these when a per-module override gives it a
compute format other than the one around it (``mixprec/policy/overrides.py``):

* ``fp32``: autocast is switched off for the layer and the input (and 16-bit weights) are upcast,
  so the GEMM and its backward run in FP32 whatever the surrounding mode does,
* ``bf16`` / ``fp16``: the GEMM runs under autocast to that dtype (also inside an FP32 model).

The output keeps the layer's compute dtype inside an autocast region (the next op casts as
autocast does); outside one it is cast back to the input's dtype, so an FP32 model's next layer
sees FP32. Parameters are the original layer's (same names, same tensors: checkpoints and an
optimizer built before the swap stay valid).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.errors import ConfigError
from mixprec.policy.overrides import format_dtype

__all__ = ["FormatLinear"]


class FormatLinear(nn.Linear):
    """``nn.Linear`` computing in ``compute_format`` (``fp32``, ``bf16`` or ``fp16``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 compute_format: str = "fp32", device: Any = None, dtype: Any = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.set_format(compute_format)

    def set_format(self, compute_format: str) -> None:
        dt = format_dtype(compute_format)
        if dt is None:
            raise ConfigError(f"FormatLinear runs fp32, bf16 or fp16, not {compute_format}; FP8 "
                              "layers are mixprec.formats.Fp8Linear")
        self.compute_format: str = compute_format
        self.compute_dtype: torch.dtype = dt

    @classmethod
    def from_linear(cls, linear: nn.Linear, compute_format: str) -> "FormatLinear":
        """A ``FormatLinear`` sharing ``linear``'s Parameters (no copy)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  compute_format=compute_format, device="meta")
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dev = x.device.type
        outer = torch.is_autocast_enabled(dev)
        if self.compute_dtype == torch.float32:
            with torch.autocast(dev, enabled=False):
                b = None if self.bias is None else self.bias.float()
                out = F.linear(x.float(), self.weight.float(), b)
        else:
            with torch.autocast(dev, dtype=self.compute_dtype, enabled=True):
                out = F.linear(x, self.weight, self.bias)
        return out if outer or out.dtype == x.dtype else out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, compute={self.compute_format}"
