"""What an FP8 recipe is made of: scaling granularity, formats, and how the GEMMs are executed.

An :class:`Fp8Config` is built from a named recipe (:meth:`Fp8Config.from_recipe`) and optionally
adjusted with keyword overrides. Every combination is checked at construction, so a config that
exists can run; an invalid one raises :class:`~mixprec.errors.ConfigError` naming the fix.

The four recipes:

* ``tensorwise`` one scale per tensor from the current amax ("current scaling"); E4M3 forward,
  E5M2 gradients (``hybrid``), the common default of FP8 training libraries.
* ``delayed``    one scale per tensor derived from an amax *history* of past steps (Transformer
  Engine style). Cheaper on GPUs (the scale is known before the tensor is read), but values above
  the historical amax saturate at the format's max.
* ``rowwise``    one scale per row of each GEMM operand along the contraction dimension; E4M3
  everywhere, power-of-two scales.
* ``blockwise``  DeepSeek-V3: 1x128 tiles for activations and gradients, 128x128 blocks for
  weights, E4M3 everywhere, FP32 accumulation promoted every 128 elements of K.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.errors import ConfigError, closest
from mixprec.policy.dtypes import FP8_E4M3, FP8_E5M2

__all__ = ["Fp8Config", "RECIPES", "SCALINGS", "FORMATS"]

SCALINGS: tuple[str, ...] = ("tensorwise", "delayed", "rowwise", "blockwise")
FORMATS: tuple[str, ...] = ("e4m3", "e5m2", "hybrid")
BACKENDS: tuple[str, ...] = ("auto", "scaled-mm", "emulated")
BLOCK_KERNELS: tuple[str, ...] = ("auto", "native", "triton")
RECIPES: tuple[str, ...] = SCALINGS


@dataclass(frozen=True, kw_only=True)
class Fp8Config:
    """How :class:`~mixprec.formats.Fp8Linear` quantizes and multiplies. Prefer :meth:`from_recipe`."""

    recipe: str = "custom"
    """Name of the recipe this config came from (shown in logs and reports)."""
    scaling: str = "tensorwise"
    """Scale granularity: ``tensorwise``, ``delayed`` (tensorwise from an amax history),
    ``rowwise`` or ``blockwise``."""
    format: str = "e4m3"
    """``e4m3`` for every GEMM operand, ``e5m2`` for every operand (emulation only: FP8 GEMM
    kernels do not multiply two E5M2 operands), or ``hybrid`` (E4M3 for activations and weights,
    E5M2 for the output gradient, whose range matters more than its precision)."""
    activation_block: tuple[int, int] = (1, 128)
    """Blockwise only: tile of activations and gradients, (rows, elements along K)."""
    weight_block: tuple[int, int] = (128, 128)
    """Blockwise only: block of the weight, (rows, elements along K). Square blocks make the same
    scales valid for the transposed weight in the input-gradient GEMM."""
    amax_history_len: int = 16
    """Delayed only: how many past amax values each tensor remembers."""
    amax_compute: str = "max"
    """Delayed only: scale from the ``max`` of the history or its ``most_recent`` entry."""
    power_of_two_scales: bool = False
    """Round every scale down to a power of two, so scaling changes only the exponent (exact)."""
    margin: int = 0
    """Keep ``2**margin`` headroom below the format's max when scaling (0 = use the full range)."""
    high_precision_wgrad: bool = False
    """Run the weight-gradient GEMM in FP32 instead of FP8 (forward and input gradient stay FP8)."""
    backend: str = "auto"
    """``auto``: ``torch._scaled_mm`` on CUDA devices with FP8 tensor cores, emulation elsewhere;
    ``scaled-mm`` or ``emulated`` to force one (forcing ``scaled-mm`` on a CPU runs PyTorch's CPU
    FP8 kernel, useful to test the GPU code path's layout and scale handling)."""
    block_kernel: str = "auto"
    """Blockwise on a CUDA scaled-mm path: which one-GEMM kernel multiplies the 1x128 / 128x128
    blocks. ``auto``: torch's native block-scaled ``scaled_mm`` where this torch has it, else
    mixprec's Triton kernel (E4M3, with Triton importable), else the emulation; ``native`` or
    ``triton`` to force one (refused at conversion on a GPU where it cannot run; ignored off
    CUDA)."""
    accum_mantissa_bits: int | None = None
    """Emulation only: accumulate GEMM partial sums with this many mantissa bits (Hopper tensor
    cores keep about 14) instead of exact FP32. None = FP32 accumulation."""
    promotion_interval: int = 128
    """Emulation only, with ``accum_mantissa_bits``: add the limited-precision partial sum into an
    FP32 accumulator every this many elements of K (DeepSeek-V3's N_C = 128)."""
    accum_chunk: int = 32
    """Emulation only, with ``accum_mantissa_bits``: K elements summed exactly inside one tensor
    core instruction before the limited-precision accumulator rounds (32 for FP8 WGMMA)."""
    compile_casts: bool = True
    """CUDA only (with Triton): run each FP8 cast (amax, scale, saturated cast) through
    ``torch.compile`` as one fused kernel. Eager elsewhere (CPUs, or False here)."""
    cache_weight_casts: bool = True
    """Reuse a weight's FP8 casts while the weight is unchanged (its ``_version`` and storage):
    micro-batches of one optimizer step cast each weight once. Costs one FP8 copy of the weight
    (two for rowwise) between steps. Not with delayed scaling (its amax history moves per call)."""
    nonfinite: str = "propagate"
    """What an inf/NaN in a GEMM operand does: ``propagate`` makes the affected outputs NaN (no host
    sync; the loss scaler / non-finite check then skips the step, and
    :func:`mixprec.formats.found_nonfinite` says so on the device), ``raise`` raises
    :class:`~mixprec.errors.NumericsError` in the layer (one host sync per forward and per
    backward of each layer, naming the operand). Never saturate."""

    def __post_init__(self) -> None:
        _choice("scaling", self.scaling, SCALINGS)
        _choice("format", self.format, FORMATS)
        _choice("backend", self.backend, BACKENDS)
        _choice("block_kernel", self.block_kernel, BLOCK_KERNELS)
        _choice("amax_compute", self.amax_compute, ("max", "most_recent"))
        _choice("nonfinite", self.nonfinite, ("propagate", "raise"))
        for name in ("activation_block", "weight_block"):
            block = tuple(getattr(self, name))
            if len(block) != 2 or not all(isinstance(b, int) and b >= 1 for b in block):
                raise ConfigError(f"Fp8Config.{name} must be two positive ints, e.g. (1, 128), not {block}")
            object.__setattr__(self, name, block)
        if self.scaling == "blockwise" and self.activation_block[0] != 1:
            raise ConfigError(f"activation_block {self.activation_block} spans several tokens; "
                              "activation tiles are one row wide: use (1, 128)")
        if self.amax_history_len < 1:
            raise ConfigError(f"amax_history_len must be >= 1, not {self.amax_history_len}")
        if self.margin < 0:
            raise ConfigError(f"margin must be >= 0 (headroom in powers of two), not {self.margin}")
        if self.accum_mantissa_bits is not None:
            if not 1 <= self.accum_mantissa_bits <= 23:
                raise ConfigError(f"accum_mantissa_bits must be in 1..23 (or None for exact FP32), "
                                  f"not {self.accum_mantissa_bits}")
            if self.backend == "scaled-mm":
                raise ConfigError("accum_mantissa_bits emulates tensor-core accumulation and needs "
                                  "backend='emulated' (or 'auto' on a CPU); real FP8 GEMMs accumulate "
                                  "as the hardware does")
        if self.accum_chunk < 1 or self.promotion_interval < self.accum_chunk or \
                self.promotion_interval % self.accum_chunk:
            raise ConfigError(f"promotion_interval ({self.promotion_interval}) must be a positive "
                              f"multiple of accum_chunk ({self.accum_chunk}), e.g. 128 and 32")
        if self.format == "e5m2" and self.backend == "scaled-mm":
            raise ConfigError("torch._scaled_mm cannot multiply two E5M2 operands; use "
                              "format='hybrid' (E4M3 forward, E5M2 gradients) or backend='emulated'")

    # --- what the GEMM code asks -------------------------------------------------------------

    @property
    def forward_dtype(self) -> torch.dtype:
        """FP8 dtype of activations and weights."""
        return FP8_E5M2 if self.format == "e5m2" else FP8_E4M3

    @property
    def grad_dtype(self) -> torch.dtype:
        """FP8 dtype of the output gradient in the two backward GEMMs."""
        return FP8_E4M3 if self.format == "e4m3" else FP8_E5M2

    @property
    def limited_accumulation(self) -> bool:
        return self.accum_mantissa_bits is not None

    def replace(self, **changes: Any) -> "Fp8Config":
        """A validated copy with some fields changed (the recipe name becomes ``custom``)."""
        changes.setdefault("recipe", "custom" if any(k not in ("backend", "block_kernel")
                                                     for k in changes) else self.recipe)
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_recipe(cls, name: str, **overrides: Any) -> "Fp8Config":
        """The named recipe (``tensorwise``, ``delayed``, ``rowwise``, ``blockwise``; an
        ``fp8-`` prefix is accepted), with optional field overrides."""
        key = str(name).strip().lower().removeprefix("fp8-")
        if key not in _RECIPE_FIELDS:
            raise ConfigError(f"unknown FP8 recipe '{name}'{closest(key, RECIPES)}; valid: "
                              f"{', '.join(RECIPES)}")
        fields = {"recipe": key, **_RECIPE_FIELDS[key], **overrides}
        return cls(**fields)

    def describe(self) -> str:
        parts = [f"{self.scaling} scaling", f"format {self.format}"]
        if self.scaling == "blockwise":
            parts.append(f"tiles {self.activation_block[0]}x{self.activation_block[1]} / "
                         f"blocks {self.weight_block[0]}x{self.weight_block[1]}")
        if self.scaling == "delayed":
            parts.append(f"amax history {self.amax_history_len} ({self.amax_compute})")
        if self.power_of_two_scales:
            parts.append("power-of-two scales")
        if self.high_precision_wgrad:
            parts.append("fp32 weight-gradient GEMM")
        if self.limited_accumulation:
            parts.append(f"{self.accum_mantissa_bits}-bit accumulation, FP32 promotion every "
                         f"{self.promotion_interval}")
        if self.block_kernel != "auto":
            parts.append(f"{self.block_kernel} block-scaled GEMM")
        return f"fp8-{self.recipe} ({', '.join(parts)}; backend {self.backend})"


_RECIPE_FIELDS: dict[str, dict[str, Any]] = {
    "tensorwise": {"scaling": "tensorwise", "format": "hybrid"},
    "delayed": {"scaling": "delayed", "format": "hybrid", "amax_history_len": 16,
                "amax_compute": "max"},
    "rowwise": {"scaling": "rowwise", "format": "e4m3", "power_of_two_scales": True},
    "blockwise": {"scaling": "blockwise", "format": "e4m3", "activation_block": (1, 128),
                  "weight_block": (128, 128)},
}


def _choice(field: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ConfigError(f"Fp8Config.{field}='{value}' is not valid{closest(str(value), valid)}; "
                          f"valid: {', '.join(valid)}")
