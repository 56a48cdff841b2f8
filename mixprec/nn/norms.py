"""Normalisation layers whose statistics are always computed in FP32.

Why: a LayerNorm computes the variance from squared deviations. In FP16 any deviation above
~256 squares past the largest finite value (65504), so rows of activations around 1e3-6e4 (which
FP16 itself can still hold) give an infinite variance, and the normalised row collapses to zero
(or NaN in backward). BF16 has the range but only 8 bits of mantissa, so a mean of many values
loses most of its precision. Both layers here therefore:

* keep their parameters in FP32 (``keep_in_fp32 = True`` tells :class:`mixprec.Policy` so, and
  :func:`mixprec.precision.cast_module` leaves them alone),
* upcast a 16-bit input to FP32, compute mean/variance, normalisation and the affine transform in
  FP32 (``eps`` is added in FP32 too, where 1e-5 is representable; in FP16 it is subnormal),
* return the input's dtype, so the next layer sees what it would have seen from a plain norm.

FP32 inputs take PyTorch's fused kernel directly (``F.layer_norm`` / ``F.rms_norm``): that *is*
the FP32 computation, so there is no reason to go through anything slower. The cost for 16-bit
inputs is one FP32 copy of the activation saved for backward.

Both layers disable any enclosing autocast for their own few ops, so the statistics stay FP32
even if a future autocast policy lists ``layer_norm`` among the lower-precision ops.
"""
from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.errors import ConfigError, closest

__all__ = ["MixedPrecisionLayerNorm", "RMSNorm", "NORM_LAYERS", "make_norm"]

_ShapeLike = int | tuple[int, ...] | list[int] | torch.Size


def _as_shape(normalized_shape: _ShapeLike) -> tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(s) for s in normalized_shape)


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    """FP32 for 16-bit (and FP32) inputs; FP64 inputs keep FP64 rather than losing precision."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class MixedPrecisionLayerNorm(nn.Module):
    """LayerNorm over the trailing ``normalized_shape`` dims with FP32 statistics and parameters.

    Same arguments and result as :class:`torch.nn.LayerNorm` in FP32; for FP16/BF16 inputs the
    result is the FP32 LayerNorm of the (exactly upcast) input, rounded once to the input dtype.
    """

    keep_in_fp32 = True
    """Read by :meth:`mixprec.Policy.keeps_fp32`: the weight and bias stay FP32 under every policy."""

    def __init__(self, normalized_shape: _ShapeLike, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.normalized_shape = _as_shape(normalized_shape)
        self.eps = float(eps)
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, dtype=torch.float32, device=device))
            self.bias = (nn.Parameter(torch.zeros(self.normalized_shape, dtype=torch.float32, device=device))
                         if bias else None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., *normalized_shape)
        sd = _stats_dtype(x)
        w = None if self.weight is None else self.weight.to(sd)  # no-op unless someone cast us
        b = None if self.bias is None else self.bias.to(sd)
        with torch.autocast(device_type=x.device.type, enabled=False):
            if x.dtype == sd:  # FP32 (or FP64) input: the fused kernel is already the exact thing
                return F.layer_norm(x, self.normalized_shape, w, b, self.eps)
            return F.layer_norm(x.to(sd), self.normalized_shape, w, b, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"bias={self.bias is not None}, stats=fp32")


class RMSNorm(nn.Module):
    """Root-mean-square norm (no mean subtraction, no bias) with FP32 statistics and weight.

    ``y = x / sqrt(mean(x**2) + eps) * weight``, computed in FP32 and returned in the input dtype.
    The mean of squares is exactly where FP16 overflows first (any element above 256).
    """

    keep_in_fp32 = True
    """Read by :meth:`mixprec.Policy.keeps_fp32`: the weight stays FP32 under every policy."""

    def __init__(self, normalized_shape: _ShapeLike, eps: float = 1e-6, elementwise_affine: bool = True,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.normalized_shape = _as_shape(normalized_shape)
        self.eps = float(eps)
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, dtype=torch.float32, device=device))
        else:
            self.register_parameter("weight", None)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., *normalized_shape)
        sd = _stats_dtype(x)
        w = None if self.weight is None else self.weight.to(sd)
        with torch.autocast(device_type=x.device.type, enabled=False):
            if x.dtype == sd:
                return F.rms_norm(x, self.normalized_shape, w, self.eps)
            return F.rms_norm(x.to(sd), self.normalized_shape, w, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, stats=fp32"


NORM_LAYERS: dict[str, type[nn.Module]] = {"layernorm": MixedPrecisionLayerNorm, "rmsnorm": RMSNorm}
"""Norm names accepted by :class:`mixprec.models.TransformerConfig` (``norm=``)."""


def make_norm(name: str, dim: int, *, bias: bool = True) -> nn.Module:
    """Build the norm called ``name`` over a trailing dimension ``dim`` (names in :data:`NORM_LAYERS`)."""
    if name == "layernorm":
        return MixedPrecisionLayerNorm(dim, bias=bias)
    if name == "rmsnorm":
        return RMSNorm(dim)
    raise ConfigError(f"unknown norm '{name}'{closest(name, NORM_LAYERS)}; valid: {', '.join(NORM_LAYERS)}")
