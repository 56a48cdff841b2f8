"""Number formats. FP8 training: E4M3/E5M2 Linear (and Hugging Face Conv1D) layers with tensorwise, delayed, rowwise and DeepSeek-V3
blockwise scaling; real FP8 GEMMs through ``torch._scaled_mm`` on GPUs with FP8 tensor cores,
faithful emulation elsewhere.

The ``fp8-*`` precision policies are declared with the other presets in
:mod:`mixprec.policy.policy`; :class:`mixprec.Precision` applies them. Their non-FP8 compute dtype is
BF16 (attention, norms' surroundings, the head: what DeepSeek-V3 runs outside its FP8 GEMMs) with
FP32 parameters (master weights) and FP32 gradient reduction. The FP8 GEMMs themselves do not use
the compute dtype: emulation runs them in FP32 after FP8 rounding. On CPUs without BF16
instructions (see ``mixprec.policy.hardware.cpu_has_native_bf16``) BF16 compute is itself
emulated and slow: FP8 emulation on a CPU is for studying numerics, not for speed.
"""
from mixprec.formats.fp8_config import FORMATS, RECIPES, SCALINGS, Fp8Config
from mixprec.formats.convert import Fp8ConversionReport, convert_to_fp8, prepare_fp8
from mixprec.formats.emulation import emulated_mm, limited_precision_matmul, round_mantissa
from mixprec.formats.fp8_linear import Fp8Conv1D, Fp8Linear, fp8_gemm, is_conv1d
from mixprec.formats.fp8_quantize import Fp8Tensor, compute_amax, dequantize, quantize, scale_from_amax, sqnr_db

__all__ = [
    # configuration
    "Fp8Config", "RECIPES", "SCALINGS", "FORMATS",
    # modules and conversion
    "Fp8Linear", "Fp8Conv1D", "is_conv1d", "convert_to_fp8", "prepare_fp8", "Fp8ConversionReport",
    # quantization
    "Fp8Tensor", "quantize", "dequantize", "compute_amax", "scale_from_amax", "sqnr_db",
    # GEMMs and emulation
    "fp8_gemm", "emulated_mm", "limited_precision_matmul", "round_mantissa",
]

