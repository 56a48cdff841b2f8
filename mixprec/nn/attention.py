"""Causal multi-head self-attention whose softmax is FP32-accurate under every policy.

The softmax over attention scores is the one place in a Transformer where low precision hurts
most: ``exp`` of a BF16/FP16 score amplifies its rounding error, and summing thousands of
probabilities in 8-11 mantissa bits drops the small ones. Two implementations are offered:

``impl="sdpa"`` (default)
    :func:`torch.nn.functional.scaled_dot_product_attention` with ``is_causal=True``. Under
    autocast it receives BF16/FP16 ``q, k, v``, but every kernel it dispatches to keeps the
    softmax in FP32: the CPU flash kernel and the CUDA flash / memory-efficient / cuDNN kernels
    accumulate ``q @ k^T``, the running max and the running sum of ``exp`` in FP32 and round only
    the output to the input dtype; the "math" fallback upcasts 16-bit inputs to FP32 unless
    ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)`` was set. That makes it
    numerically equivalent to an FP32 softmax up to the rounding of its 16-bit inputs and output
    (tests/nn/test_attention.py checks it against an FP32 reference), and it never materialises
    the ``(T, T)`` score matrix on the fused paths. On a CPU without AMX, for short sequences
    16-bit ``q, k, v`` are cast to FP32 for the kernel and the output rounded back: faster there,
    and no less accurate (see ``_sdpa_upcast_dtype``).
``impl="math"``
    The explicit reference: FP32 scores from the 16-bit ``q, k``, causal mask, FP32 softmax,
    probabilities rounded once to ``v``'s dtype for ``probs @ v`` (autocast disabled inside). It materialises ``(B, H, T, T)`` and is meant for
    testing and for inspecting attention weights, not for speed.

Both support attention dropout (``dropout`` > 0, active only in training).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.errors import ConfigError
from mixprec.policy.hardware import cpu_matrix_flags

__all__ = ["CausalSelfAttention", "ATTENTION_IMPLS", "causal_attention_fp32_softmax"]

ATTENTION_IMPLS = ("sdpa", "math")


def causal_attention_fp32_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  dropout_p: float = 0.0, training: bool = False) -> torch.Tensor:
    """Causal attention with an explicit FP32 softmax. ``q, k, v``: (B, H, T, hs) -> (B, H, T, hs)."""
    T, hs = q.shape[-2], q.shape[-1]
    with torch.autocast(device_type=q.device.type, enabled=False):
        # Scores from the (possibly 16-bit) q, k with FP32 products and sums, as the fused kernels
        # do: rounding a score of ~50 to BF16 would move it by 0.25 and the softmax by 25%.
        scores = (q.float() @ k.float().transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, H, T, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu_(1)  # True above the diagonal
        scores = scores.masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # fp32; every row keeps its diagonal: no all -inf row
        if dropout_p > 0.0 and training:
            probs = F.dropout(probs, p=dropout_p)
        return probs.to(v.dtype) @ v  # (B, H, T, hs), probabilities rounded once for the v matmul


_UPCAST_MAX_T_TIMES_D = 8192


def upcasts_short_attention(device_type: str, dtype: torch.dtype, seq_len: int, head_size: int) -> bool:
    """Whether 16-bit attention inputs of this shape run SDPA in FP32 here (see below); the memory
    estimator asks this too (the FP32 kernel saves q, k, v and its output in FP32)."""
    return (device_type == "cpu" and dtype in (torch.bfloat16, torch.float16)
            and seq_len * head_size <= _UPCAST_MAX_T_TIMES_D
            and not any(flag.startswith("amx") for flag in cpu_matrix_flags()))


def _sdpa_upcast_dtype(q: torch.Tensor) -> torch.dtype | None:
    """FP32 when ``q`` is BF16/FP16 on a CPU without AMX and the sequence is short, else None.

    PyTorch's CPU flash-attention kernel is slower on 16-bit inputs than on FP32 ones for short
    sequences on such CPUs, and faster for long ones. Measured forward + backward on avx512_bf16
    without AMX (``benchmarks/attention_dtype.py``, docs/performance.md), FP32 against BF16:
    2.45x faster at T=128, head size 32, 4.4x at 64x16, 1.64x at 128x64, 1.28x at 256x32; but
    0.96x at 256x64, 1.03x at 512x32, 0.87x at 512x64 and 0.77x at 1024x32. So 16-bit inputs
    are cast up when ``T * head_size <= 8192`` (every measured case that gained 1.28x or more,
    none that lost). The FP32 kernel computes the softmax and both products in FP32 on the same
    16-bit-rounded inputs, so it is at least as accurate. AMX CPUs were not measured and keep the
    16-bit kernel.
    """
    if upcasts_short_attention(q.device.type, q.dtype, q.shape[-2], q.shape[-1]):
        return torch.float32
    return None


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection.

    ``x: (B, T, C) -> (B, T, C)`` with ``C = d_model`` split over ``num_heads`` heads of size
    ``C // num_heads``. ``dropout`` applies to the attention probabilities and to the output
    projection (training only).
    """

    def __init__(self, d_model: int, num_heads: int, *, dropout: float = 0.0, bias: bool = True,
                 impl: str = "sdpa") -> None:
        super().__init__()
        if d_model % num_heads != 0:
            raise ConfigError(f"d_model {d_model} is not divisible by num_heads {num_heads}; "
                              "choose num_heads dividing d_model (e.g. d_model 512 with 8 heads)")
        if impl not in ATTENTION_IMPLS:
            raise ConfigError(f"unknown attention impl '{impl}'; valid: {', '.join(ATTENTION_IMPLS)}")
        if not 0.0 <= dropout < 1.0:
            raise ConfigError(f"attention dropout must be in [0, 1), got {dropout}")
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, d_model // num_heads
        self.dropout, self.impl = float(dropout), impl
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)
        self.proj.is_residual_projection = True  # GPT-2 init scales it by 1/sqrt(2 * num_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (B, H, T, hs)
        p = self.dropout if self.training else 0.0
        if self.impl == "sdpa":
            wide = _sdpa_upcast_dtype(q)
            if wide is None:
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
            else:   # autocast off, or it would cast the inputs back; rounded once at the end
                with torch.autocast("cpu", enabled=False):
                    y = F.scaled_dot_product_attention(q.to(wide), k.to(wide), v.to(wide),
                                                       dropout_p=p, is_causal=True).to(q.dtype)
        else:
            y = causal_attention_fp32_softmax(q, k, v, dropout_p=p, training=self.training)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        y = self.proj(y)
        return F.dropout(y, p=p, training=True) if p > 0.0 else y

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, num_heads={self.num_heads}, impl={self.impl}, dropout={self.dropout}"
