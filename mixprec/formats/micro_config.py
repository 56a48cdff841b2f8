"""What a micro-format recipe is made of: element and scale formats, block, and NVFP4's options.

Three named recipes (:meth:`MicroConfig.from_recipe`), one per layer format:

* ``mxfp8``  E4M3 elements for every GEMM operand, one E8M0 scale per 32 elements along the
  reduction dimension (OCP MX v1.0; the MXFP8 recipe Blackwell GPUs train in);
* ``mxfp4``  E2M1 elements, E8M0 scales per 32 (OCP MX v1.0); no further options by default;
* ``nvfp4``  E2M1 elements, one E4M3 scale per 16 elements and an FP32 scale per tensor, with the
  options of NVIDIA's NVFP4 pre-training recipe ("Pretraining Large Language Models with
  NVFP4", arXiv:2509.25149, 2025) all on by default:

  - ``hadamard_wgrad``: a 16x16 random Hadamard transform (Hadamard matrix times a random sign
    vector, fixed per run) applied to both inputs of the weight-gradient GEMM along its
    reduction (token) dimension. It is orthogonal, so the product is unchanged in exact
    arithmetic, and it spreads a block's outliers over its 16 elements before they are quantized;
  - ``weight_2d``: the weight gets one scale per 16x16 block, so the forward GEMM and the
    input-gradient GEMM (which reads the weight transposed) see the *same* quantized weight;
  - ``stochastic_grad``: the output gradient is rounded stochastically in both backward GEMMs
    (unbiased; round-to-nearest-even everywhere else);
  - ``bf16_first`` / ``bf16_last``: under the ``nvfp4`` preset the first / last that many blocks
    of the model (a numbered ``nn.ModuleList`` of blocks, e.g. ``blocks.3``) keep their Linears in
    BF16. NVIDIA keeps about 16 % of the layers, mostly the last ones, in BF16; ``bf16_last=None``
    is that share: ``ceil(0.16 * number of blocks)``. A per-layer override naming ``nvfp4``
    explicitly is obeyed as written.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from mixprec.errors import ConfigError, closest
from mixprec.formats.mx import ELEMENTS
from mixprec.policy.overrides import MICRO_FORMATS

__all__ = ["MicroConfig", "MICRO_RECIPES", "BF16_SHARE", "parse_micro_options"]

MICRO_RECIPES: tuple[str, ...] = MICRO_FORMATS
BF16_SHARE = 0.16
"""Share of blocks NVIDIA's NVFP4 recipe keeps in BF16 (``bf16_last=None``)."""


@dataclass(frozen=True, kw_only=True)
class MicroConfig:
    """How :class:`~mixprec.formats.mx_linear.MicroLinear` quantizes. Prefer :meth:`from_recipe`."""

    recipe: str = "custom"
    """The recipe this came from (the layer format's name)."""
    element: str = "e4m3"
    """Element format of activations and weights: ``e4m3``, ``e5m2`` or ``e2m1``."""
    grad_element: str = "e4m3"
    """Element format of the output gradient in the two backward GEMMs."""
    scale: str = "e8m0"
    """``e8m0`` (OCP MX: power-of-two scale per 32) or ``nvfp4`` (E4M3 per 16 + FP32 per tensor)."""
    hadamard_wgrad: bool = False
    """Random 16x16 Hadamard transform on both weight-gradient GEMM inputs (NVFP4 recipe)."""
    weight_2d: bool = False
    """One scale per 16x16 weight block instead of per 1x16 run (NVFP4 only)."""
    stochastic_grad: bool = False
    """Stochastic rounding of the output gradient in the backward GEMMs."""
    bf16_first: int = 0
    """Preset only: keep the Linears of the first this many blocks in BF16."""
    bf16_last: int | None = 0
    """Preset only: keep the last this many blocks in BF16; None: ``ceil(16 % of the blocks)``."""
    seed: int = 0
    """Seed of the Hadamard sign vector and the stochastic-rounding stream."""

    def __post_init__(self) -> None:
        for name in ("element", "grad_element"):
            value = getattr(self, name)
            if value not in ELEMENTS:
                raise ConfigError(f"MicroConfig.{name}='{value}' is not valid{closest(value, ELEMENTS)}; "
                                  f"valid: {', '.join(ELEMENTS)}")
        if self.scale not in ("e8m0", "nvfp4"):
            raise ConfigError(f"MicroConfig.scale must be 'e8m0' (MX) or 'nvfp4', not '{self.scale}'")
        if self.scale == "nvfp4" and (self.element, self.grad_element) != ("e2m1", "e2m1"):
            raise ConfigError("NVFP4 scales go with E2M1 elements (element='e2m1', grad_element='e2m1')")
        if self.weight_2d and self.scale != "nvfp4":
            raise ConfigError("weight_2d (16x16 weight blocks) is an NVFP4 option; MX scales are 1x32")
        if self.bf16_first < 0 or (self.bf16_last is not None and self.bf16_last < 0):
            raise ConfigError("bf16_first / bf16_last count blocks and must be >= 0")

    @property
    def block(self) -> int:
        """Elements per scale along the reduction dimension."""
        return 16 if self.scale == "nvfp4" else 32

    def kept_blocks(self, num_blocks: int) -> tuple[int, int]:
        """(first, last) block counts kept in BF16 for a model of ``num_blocks`` blocks."""
        last = math.ceil(BF16_SHARE * num_blocks) if self.bf16_last is None else self.bf16_last
        return min(self.bf16_first, num_blocks), min(last, num_blocks)

    def replace(self, **changes: Any) -> "MicroConfig":
        """A validated copy with some fields changed (the recipe name is kept: options tune a
        recipe, they do not make another format)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_recipe(cls, name: str, **options: Any) -> "MicroConfig":
        """The named recipe (``mxfp8``, ``mxfp4``, ``nvfp4``) with optional field changes."""
        key = str(name).strip().lower()
        if key not in _RECIPES:
            raise ConfigError(f"unknown micro-format recipe '{name}'{closest(key, MICRO_RECIPES)}; "
                              f"valid: {', '.join(MICRO_RECIPES)}")
        unknown = [k for k in options if k not in {f.name for f in dataclasses.fields(cls)} - {"recipe"}]
        if unknown:
            valid = [f.name for f in dataclasses.fields(cls) if f.name != "recipe"]
            raise ConfigError(f"unknown micro-format option '{unknown[0]}'{closest(unknown[0], valid)}; "
                              f"valid: {', '.join(valid)}")
        return cls(recipe=key, **{**_RECIPES[key], **options})

    def describe(self) -> str:
        scales = ("E4M3 per 16 + FP32 per tensor" if self.scale == "nvfp4" else "E8M0 per 32")
        parts = [f"{self.element.upper()} elements", f"{self.grad_element.upper()} gradients", scales]
        opts = [n for n, on in (("2-D 16x16 weight blocks", self.weight_2d),
                                ("Hadamard on wgrad inputs", self.hadamard_wgrad),
                                ("stochastic rounding of gradients", self.stochastic_grad)) if on]
        if self.bf16_first or self.bf16_last != 0:
            last = "16 %" if self.bf16_last is None else str(self.bf16_last)
            opts.append(f"first {self.bf16_first} / last {last} blocks bf16")
        return f"{self.recipe} ({', '.join(parts + opts)})"


def parse_micro_options(options: Any) -> tuple[tuple[str, Any], ...]:
    """``{"hadamard_wgrad": False}``, pairs, or the command-line text
    ``"hadamard_wgrad=false,bf16_last=0"`` -> checked ``((name, value), ...)`` (values typed as
    the :class:`MicroConfig` fields are)."""
    if not options:
        return ()
    if isinstance(options, str):
        pairs = []
        for part in options.replace(";", ",").split(","):
            if not part.strip():
                continue
            key, sep, value = part.partition("=")
            if not sep:
                raise ConfigError(f"cannot read micro option '{part}': write name=value, e.g. "
                                  "'hadamard_wgrad=false,stochastic_grad=false'")
            pairs.append((key.strip(), value.strip()))
    else:
        pairs = list(options.items()) if isinstance(options, dict) else [tuple(p) for p in options]
    kinds = {f.name: f.type for f in dataclasses.fields(MicroConfig) if f.name != "recipe"}
    out = []
    for key, value in pairs:
        if key not in kinds:
            raise ConfigError(f"unknown micro-format option '{key}'{closest(key, kinds)}; valid: "
                              f"{', '.join(kinds)}")
        out.append((key, _coerce(key, value, kinds[key])))
    return tuple(out)


def _coerce(key: str, value: Any, kind: str) -> Any:
    if not isinstance(value, str):
        return value
    v = value.strip().lower()
    if kind == "bool":
        if v in ("1", "true", "yes", "on"):
            return True
        if v in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"micro option {key} is true or false, not '{value}'")
    if kind.startswith("int"):
        if v in ("none", "auto") and "None" in kind:
            return None
        try:
            return int(v)
        except ValueError:
            raise ConfigError(f"micro option {key} is a whole number, not '{value}'") from None
    return value.strip()


_RECIPES: dict[str, dict[str, Any]] = {
    "mxfp8": {"element": "e4m3", "grad_element": "e4m3", "scale": "e8m0"},
    "mxfp4": {"element": "e2m1", "grad_element": "e2m1", "scale": "e8m0"},
    "nvfp4": {"element": "e2m1", "grad_element": "e2m1", "scale": "nvfp4", "hadamard_wgrad": True,
              "weight_2d": True, "stochastic_grad": True, "bf16_first": 0, "bf16_last": None},
}
