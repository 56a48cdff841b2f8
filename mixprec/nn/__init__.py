"""Numerics-safe layers: FP32-statistics norms, FP32-softmax attention, MoE with an FP32 router,
and opt-in activation clamping and FP8-stored activations."""
from mixprec.nn.attention import ATTENTION_IMPLS, CausalSelfAttention, causal_attention_fp32_softmax
from mixprec.nn.format_linear import FormatLinear
from mixprec.nn.clamp import DEFAULT_CLAMP_BOUND, ClampHandle, clamp_activations
from mixprec.nn.fp8_activations import Fp8ActivationStore, store_activations_in_fp8
from mixprec.nn.moe import Expert, MoEGate, MoELayer
from mixprec.nn.norms import NORM_LAYERS, MixedPrecisionLayerNorm, RMSNorm, make_norm

__all__ = [
    # norms
    "MixedPrecisionLayerNorm", "RMSNorm", "NORM_LAYERS", "make_norm",
    # attention
    "CausalSelfAttention", "causal_attention_fp32_softmax", "ATTENTION_IMPLS",
    # mixture of experts
    "MoELayer", "MoEGate", "Expert",
    # per-layer compute format
    "FormatLinear",
    # clamping
    "clamp_activations", "ClampHandle", "DEFAULT_CLAMP_BOUND",
    # activations saved for backward in FP8
    "store_activations_in_fp8", "Fp8ActivationStore",
]
