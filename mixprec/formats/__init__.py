"""Block-scaled micro formats: MXFP8, MXFP4 and NVFP4 quantizers (bit-exact), the Linear layer that
trains in them (emulated on every device for now), and the conversion that swaps it in.

The ``mxfp8`` / ``mxfp4`` / ``nvfp4`` precision presets and per-layer formats are declared with the
other formats in :mod:`mixprec.precision.overrides` and :mod:`mixprec.precision.policy`;
:class:`mixprec.Precision` applies them. See docs/micro-formats.md.
"""
from mixprec.formats.micro_config import BF16_SHARE, MICRO_RECIPES, MicroConfig
from mixprec.formats.mx import (E2M1_VALUES, ELEMENTS, BlockScaledTensor, ElementFormat, quantize_mx,
                                quantize_nvfp4, round_to_grid)
from mixprec.formats.mx_convert import MicroConversionReport, block_index, convert_to_micro
from mixprec.formats.mx_linear import MicroLinear, hadamard_matrix, quantize_operand

__all__ = [
    # configuration
    "MicroConfig", "MICRO_RECIPES", "BF16_SHARE",
    # quantization
    "quantize_mx", "quantize_nvfp4", "BlockScaledTensor", "ElementFormat", "ELEMENTS", "E2M1_VALUES",
    "round_to_grid",
    # modules and conversion
    "MicroLinear", "quantize_operand", "hadamard_matrix", "convert_to_micro", "MicroConversionReport",
    "block_index",
]
