"""Number formats.

FP8 training: E4M3/E5M2 Linear (and Hugging Face Conv1D) layers with tensorwise, delayed, rowwise and DeepSeek-V3
blockwise scaling; real FP8 GEMMs through ``torch._scaled_mm`` (and torch's native block-scaled
``scaled_mm`` for blockwise) on GPUs with FP8 tensor cores, faithful emulation elsewhere. Casts are
lean (:mod:`~mixprec.formats.fp8_cast`), the path is decided once at conversion
(:mod:`~mixprec.formats.fp8_path`), and an inf/NaN operand is recorded on the device
(:func:`found_nonfinite`, no host sync per cast).

The ``fp8-*`` precision policies are declared with the other presets in
:mod:`mixprec.policy.policy`; :class:`mixprec.Precision` applies them. Their non-FP8 compute dtype is
BF16 (attention, norms' surroundings, the head: what DeepSeek-V3 runs outside its FP8 GEMMs) with
FP32 parameters (master weights) and FP32 gradient reduction. The FP8 GEMMs themselves do not use
the compute dtype: emulation runs them in FP32 after FP8 rounding. On CPUs without BF16
instructions (see ``mixprec.policy.hardware.cpu_has_native_bf16``) BF16 compute is itself
emulated and slow: FP8 emulation on a CPU is for studying numerics, not for speed.

Block-scaled micro formats: MXFP8, MXFP4 and NVFP4 quantizers (bit-exact against the OCP MX v1.0
scale rules and NVIDIA's NVFP4 recipe), the Linear layer that trains in them (emulated on every
device for now). The ``mxfp8`` / ``mxfp4`` / ``nvfp4`` presets and per-layer formats are declared
with the others in :mod:`mixprec.policy`; :class:`mixprec.Precision` applies them, converting
with :func:`mixprec.precision.convert_to_micro`. See docs/micro-formats.md.
"""
from mixprec import _moved
from mixprec.formats.fp8_config import FORMATS, RECIPES, SCALINGS, Fp8Config
from mixprec.formats.emulation import emulated_mm, limited_precision_matmul, round_mantissa
from mixprec.formats.fp8_linear import Fp8Conv1D, Fp8Linear, fp8_gemm, is_conv1d
from mixprec.formats.fp8_nonfinite import found_nonfinite, nonfinite_layers, reset_nonfinite
from mixprec.formats.fp8_path import GemmPlan, plan_gemms
from mixprec.formats.fp8_quantize import Fp8Tensor, compute_amax, dequantize, quantize, scale_from_amax, sqnr_db
from mixprec.formats.micro_config import BF16_SHARE, MICRO_RECIPES, MicroConfig
from mixprec.formats.mx import (E2M1_VALUES, ELEMENTS, BlockScaledTensor, ElementFormat, quantize_mx,
                                quantize_nvfp4, round_to_grid)
from mixprec.formats.mx_linear import MicroLinear, hadamard_matrix, plan_micro_gemms, quantize_operand

__all__ = [
    # configuration
    "Fp8Config", "RECIPES", "SCALINGS", "FORMATS",
    # modules and conversion
    "Fp8Linear", "Fp8Conv1D", "is_conv1d",
    # quantization
    "Fp8Tensor", "quantize", "dequantize", "compute_amax", "scale_from_amax", "sqnr_db",
    # GEMMs, their path (decided once) and emulation
    "fp8_gemm", "GemmPlan", "plan_gemms", "emulated_mm", "limited_precision_matmul", "round_mantissa",
    # non-finite FP8 operands, read once per step on the device
    "found_nonfinite", "reset_nonfinite", "nonfinite_layers",
    # micro formats: configuration, quantization, modules and conversion
    "MicroConfig", "MICRO_RECIPES", "BF16_SHARE",
    "quantize_mx", "quantize_nvfp4", "BlockScaledTensor", "ElementFormat", "ELEMENTS", "E2M1_VALUES",
    "round_to_grid",
    "MicroLinear", "quantize_operand", "hadamard_matrix", "plan_micro_gemms",
]



def __getattr__(name: str):
    _moved.refuse(__name__, name)     # a name that moved up, to mixprec.precision: one line saying where
