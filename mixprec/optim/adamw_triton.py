"""One chunk's AdamW update as ONE Triton kernel launch, for the flat master-weight step on CUDA.

The flat step (:mod:`mixprec.optim.flat`) gathers a chunk of masters into FP32 scratch ``W``
(values) and ``G`` (gradients); today its *twin* optimizer then updates them with torch's
foreach AdamW (12 dispatched ops) or mixprec's ``_AdamWFP32Math`` (33 with BF16 moments). This
kernel does the same update in one launch: each program loads a block of ``W``, ``G`` and the
two moments (FP32, or BF16 widened to FP32), updates them and stores them back, BF16 moments
rounded stochastically with the noise the twin draws (the same two ``randint`` draws from its
generator, passed in: bit-identity with the foreach path matters more than those two launches)
or to nearest.

The FP32 operations are torch's CUDA foreach AdamW's (``_multi_tensor_adamw``, non-capturable),
in its order, with its fused multiply-adds made explicit (``tl.fma``) and no others: the launch
passes ``enable_fp_fusion=False``, so the compiler contracts nothing else. Per element::

    w = w * (1 - lr*wd)                                  only when wd != 0
    m = fma(1 - b1, g - m, m)                            torch's lerp, weight < 0.5
      = fma(-(g - m), 1 - (1 - b1), g)                   ... weight >= 0.5
    v = fma(1 - b2, g * g, v * b2)                       mul_, then addcmul_ (v + s * (g * g))
    d = sqrt_rn(v) /rn sqrt(1 - b2**t) + eps             sqrt, div_, add_
    w = fma(-lr / (1 - b1**t), m /rn d, w)               addcdiv_ (w + s * (m / d))

with every host scalar computed in double as torch computes it and rounded once to FP32 (the
kernel's argument type), as torch's kernels cast their scalars. torch's CPU kernels order two of
these differently (``addcmul`` as ``fma(s * g, g, v)``, ``addcdiv`` as ``w + (s * m) / d``) and
its CPU ``sqrt`` is not always correctly rounded, so against the CPU twin the kernel agrees to
about an FP32 ulp, not bit for bit (tests/optim/test_adamw_triton.py states the measured figure);
on a GPU the flat step probes it against the twin once per device before using it.

``found``: a one-byte device flag (the step's ``found_inf > 0``); where it is set every program
returns before storing anything, so nothing is written and no ``torch.where`` pass follows. The
step counter is the caller's (a CPU tensor, as torch's non-capturable AdamW keeps it).

Imported lazily by :mod:`mixprec.optim.flat_kernel` on CUDA only, so the package imports without Triton.
Under ``TRITON_INTERPRET=1`` (set before Triton is imported) the same kernel runs on a CPU: that
is how the tests check it.
"""
from __future__ import annotations

import contextlib
import struct

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["BLOCK", "adamw_chunk_"]

BLOCK = 1024
"""Elements per program: one fixed configuration (4 warps), not autotuned: the kernel has run
only under the interpreter so far, with no GPU measurement to tune against."""

FP32, BF16_NEAREST, BF16_STOCHASTIC = 0, 1, 2
"""How the moments are stored (the kernel's ``MOMENTS``)."""


@triton.jit
def _adamw_chunk_kernel(w_ptr, g_ptr, m_ptr, v_ptr, m_noise_ptr, v_noise_ptr, found_ptr, n,
                        decay, w1, beta2, c2, bc2_sqrt, eps, step_size,
                        DECAY: tl.constexpr, SMALL_WEIGHT: tl.constexpr, MOMENTS: tl.constexpr,
                        HAS_FOUND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if HAS_FOUND:                  # a skipped step: every load and store masked off
        mask = mask & (tl.load(found_ptr) == 0)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if DECAY:
        w = w * decay
    diff = g - m
    if SMALL_WEIGHT:
        m = tl.fma(diff, w1, m)
    else:
        m = tl.fma(-diff, 1.0 - w1, g)
    v = tl.fma(g * g, c2, v * beta2)
    denom = tl.math.div_rn(tl.math.sqrt_rn(v), bc2_sqrt) + eps
    w = tl.fma(tl.math.div_rn(m, denom), step_size, w)
    tl.store(w_ptr + offs, w, mask=mask)
    if MOMENTS == 2:        # BF16, stochastic: + 16 random low bits, truncated (adamw's rule)
        mb = m.to(tl.int32, bitcast=True) + tl.load(m_noise_ptr + offs, mask=mask, other=0)
        vb = v.to(tl.int32, bitcast=True) + tl.load(v_noise_ptr + offs, mask=mask, other=0)
        tl.store(m_ptr + offs, (mb >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
        tl.store(v_ptr + offs, (vb >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
    elif MOMENTS == 1:      # BF16, to nearest even
        tl.store(m_ptr + offs, m.to(tl.bfloat16), mask=mask)
        tl.store(v_ptr + offs, v.to(tl.bfloat16), mask=mask)
    else:
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)


def adamw_chunk_(w: Tensor, g: Tensor, m: Tensor, v: Tensor, *, lr: float, beta1: float, beta2: float,
                 eps: float, weight_decay: float, step: float, found: Tensor | None = None,
                 noise: tuple[Tensor, Tensor] | None = None) -> None:
    """One AdamW update of the flat FP32 ``w`` with gradient ``g`` and moments ``m``/``v`` (FP32,
    or BF16: rounded with ``noise``, two int32 tensors in [0, 2**16) like ``w``, else to nearest),
    in place, in one launch. ``step``: the step count after this step (the bias corrections');
    ``found``: a 0-dim bool or uint8 on ``w``'s device, nonzero = write nothing."""
    n = w.numel()
    for t in (w, g, m, v):
        if t.device != w.device or t.numel() != n or not t.is_contiguous():
            raise ValueError("adamw_chunk_ takes contiguous flat tensors of one length on one device")
    if w.dtype != torch.float32 or g.dtype != torch.float32:
        raise ValueError(f"adamw_chunk_ steps FP32 values and gradients, got {w.dtype}/{g.dtype}")
    if m.dtype != v.dtype or m.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"adamw_chunk_ keeps FP32 or BF16 moments, got {m.dtype}/{v.dtype}")
    if n == 0:
        return
    if m.dtype == torch.float32:
        moments, m_noise, v_noise = FP32, w, w
    elif noise is None:
        moments, m_noise, v_noise = BF16_NEAREST, w, w
    else:
        moments, (m_noise, v_noise) = BF16_STOCHASTIC, noise
    # The host scalars, in double, as torch's _multi_tensor_adamw and mixprec's _AdamWFP32Math
    # compute them (the kernel's FP32 arguments round each once, as torch's kernels cast them).
    bias1 = 1.0 - beta1**step
    bias2_sqrt = (1.0 - beta2**step) ** 0.5
    weight = 1.0 - beta1
    weight32 = struct.unpack("f", struct.pack("f", weight))[0]   # torch picks lerp's form in FP32
    flag = w if found is None else found.view(torch.uint8) if found.dtype == torch.bool else found
    grid = (triton.cdiv(n, BLOCK),)
    # Triton launches on the current device: make it w's (a chunk on another GPU than the current)
    guard = torch.cuda.device(w.device) if w.device.type == "cuda" else contextlib.nullcontext()
    with guard:
        _adamw_chunk_kernel[grid](w, g, m, v, m_noise, v_noise, flag, n,
                                  1.0 - lr * weight_decay, weight, beta2, 1.0 - beta2, bias2_sqrt, eps,
                                  (lr / bias1) * -1,
                                  DECAY=weight_decay != 0.0, SMALL_WEIGHT=abs(weight32) < 0.5,
                                  MOMENTS=moments, HAS_FOUND=found is not None, BLOCK=BLOCK,
                                  num_warps=4, enable_fp_fusion=False)
