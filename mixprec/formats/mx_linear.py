"""``MicroLinear``: an ``nn.Linear`` whose three GEMMs run in MXFP8, MXFP4 or NVFP4 (emulated).

For ``y = x W^T`` (x: (M, K) tokens x in-features, W: (N, K)) training runs three GEMMs, and a
block-scaled GEMM needs both operands' blocks to run along its *reduction* dimension, as the
hardware's block-scaled MMA does:

==============  ====================  ======================================================
GEMM            reduction             operands, each quantized along it
==============  ====================  ======================================================
forward         K (in-features)       x (M, K), W (N, K)
input grad      N (out-features)      dy (M, N), W^T (K, N)
weight grad     M (tokens)            dy^T (N, M), x^T (K, M)
==============  ====================  ======================================================

So ``dy`` is quantized twice and ``x`` and ``W`` are re-quantized along the other dimension in
backward. With NVFP4's ``weight_2d`` the weight has 16x16 blocks, valid both ways: the input-grad
GEMM reuses the forward's quantized weight. With ``hadamard_wgrad`` both weight-grad operands are
multiplied by the same 16x16 random Hadamard matrix along M first (orthogonal: the product is
unchanged up to rounding, outliers are spread over 16 elements). With ``stochastic_grad`` the
output gradient is rounded stochastically (its own generator, seeded from the recipe's seed and
the layer's name; not checkpointed: a resumed run draws a different stream).

Execution path: decided once, at construction, by :func:`plan_micro_gemms` (the one decider for
micro formats, as :func:`mixprec.formats.plan_gemms` is for FP8): always ``emulated`` here:
operands are quantized with their real scales (:mod:`mixprec.formats.mx`), dequantized and
multiplied in FP32, so every quantization error is real and only the accumulation order differs
from a Blackwell tensor core. ``execution_path`` and
``execution_reason`` say so, as :class:`mixprec.formats.Fp8Linear`'s do; the conversion logs it.
"""
from __future__ import annotations

import logging
import zlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.formats.fp8_path import GemmPlan
from mixprec.formats.micro_config import MicroConfig
from mixprec.formats.mx import BlockScaledTensor, quantize_mx, quantize_nvfp4

__all__ = ["MicroLinear", "hadamard_matrix", "quantize_operand", "plan_micro_gemms"]

log = logging.getLogger(__name__)

_HADAMARD = 16


def hadamard_matrix(n: int = _HADAMARD, *, seed: int = 0, device: Any = None) -> torch.Tensor:
    """The orthonormal ``n x n`` random Hadamard matrix ``diag(s) @ H_n / sqrt(n)`` (Sylvester
    ``H_n``, ``s`` a random sign vector drawn from ``seed``)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, not {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
    return (signs[:, None] * h / n ** 0.5).to(device)


def _rotate(t: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``t`` (R, M) times block-diagonal ``h`` along M (zero-padded to a multiple of its size)."""
    n = h.shape[0]
    pad = -t.shape[1] % n
    if pad:
        t = F.pad(t, (0, pad))
    R, M = t.shape
    return (t.contiguous().reshape(-1, n) @ h).reshape(R, M)


def quantize_operand(t: torch.Tensor, config: MicroConfig, *, grad: bool = False, weight: bool = False,
                     generator: torch.Generator | None = None) -> BlockScaledTensor:
    """Quantize one GEMM operand laid out (rows, reduction) as ``config`` says."""
    rounding = "stochastic" if grad and config.stochastic_grad else "nearest"
    if config.scale == "nvfp4":
        block = (16, 16) if weight and config.weight_2d else (1, 16)
        return quantize_nvfp4(t, block=block, rounding=rounding, generator=generator)
    element = config.grad_element if grad else config.element
    return quantize_mx(t, element, block=config.block, rounding=rounding, generator=generator)


_EMULATED = ("no block-scaled GEMM kernel in mixprec yet: operands quantized with their real "
             "scales, multiplied in FP32 (numerics, not speed)")


def plan_micro_gemms(config: MicroConfig, device: torch.device | str | None, in_features: int,
                     out_features: int) -> GemmPlan:
    """The path of a micro-format layer's three GEMMs (``in_features -> out_features`` with
    ``config`` on ``device``): the one decider for micro formats, asked by :class:`MicroLinear`
    at construction and by the conversion's report. ``emulated`` on every device and shape: no
    block-scaled GEMM kernel is used yet (a Blackwell kernel would be chosen here)."""
    return GemmPlan("emulated", _EMULATED)


class MicroLinear(nn.Linear):
    """``nn.Linear`` with block-scaled forward, input-gradient and weight-gradient GEMMs.

    Build one from an existing layer with :meth:`from_linear`: the ``weight``/``bias`` Parameters
    are reused (FP32 or BF16 masters, never modified; quantized copies exist only inside a step).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 config: MicroConfig | None = None, device: Any = None, dtype: Any = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.config = config or MicroConfig.from_recipe("mxfp8")
        self.fqn = ""
        """Qualified name in the model (set by the conversion), used in logs."""
        plan = plan_micro_gemms(self.config, device, in_features, out_features)
        self.execution_path: str = plan.path
        """Decided at construction by :func:`plan_micro_gemms` (``emulated``)."""
        self.execution_reason: str = plan.reason
        self._generator: torch.Generator | None = None
        self._hadamard: torch.Tensor | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: MicroConfig, *, fqn: str = "") -> "MicroLinear":
        """A ``MicroLinear`` sharing ``linear``'s Parameters (no copy)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  config=config, device="meta")
        new.weight, new.bias = linear.weight, linear.bias
        new.fqn = fqn
        new.train(linear.training)
        log.info("MicroLinear %s (%d->%d, %s): %s path (%s)", fqn or "<unnamed>", new.in_features,
                 new.out_features, config.recipe, new.execution_path, new.execution_reason)
        return new

    def _rng(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            seed = self.config.seed * 1_000_003 + zlib.crc32(self.fqn.encode())
            self._generator = torch.Generator(device=device).manual_seed(seed)
        return self._generator

    def _rotation(self, device: torch.device) -> torch.Tensor:
        if self._hadamard is None or self._hadamard.device != device:
            self._hadamard = hadamard_matrix(_HADAMARD, seed=self.config.seed, device=device)
        return self._hadamard

    def _select_path(self) -> str:
        """The path decided at construction (kept for callers; forward does not ask)."""
        return self.execution_path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        lead = x.shape[:-1]
        out = _MicroLinearFn.apply(x.reshape(-1, self.in_features), self.weight, self)
        out = out.reshape(*lead, self.out_features).to(out_dtype)
        return out if self.bias is None else out + self.bias.to(out_dtype)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, recipe={self.config.recipe}, "
                f"path={self.execution_path}")


class _MicroLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, mod: MicroLinear) -> torch.Tensor:
        cfg = mod.config
        with torch.autocast(x.device.type, enabled=False):
            xq = quantize_operand(x, cfg).dequantize()                      # (M, K) along K
            wq = quantize_operand(weight, cfg, weight=True).dequantize()    # (N, K) along K
            out = xq @ wq.t()                                               # (M, N), FP32
        ctx.save_for_backward(x, weight, wq if cfg.weight_2d else None)
        ctx.mod = mod
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, wq = ctx.saved_tensors
        mod: MicroLinear = ctx.mod
        cfg = mod.config
        g = grad_out.float()                                                # (M, N)
        gen = mod._rng(g.device) if cfg.stochastic_grad else None
        grad_x = grad_w = None
        with torch.autocast(g.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                # dx = dy @ W: reduction over N; dy rows and W^T rows (K, N) blocked along N.
                gq = quantize_operand(g, cfg, grad=True, generator=gen).dequantize()
                wt = wq.t() if wq is not None else \
                    quantize_operand(weight.t().contiguous(), cfg, weight=True).dequantize()
                grad_x = (gq @ wt.t()).to(x.dtype)                          # (M, K)
            if ctx.needs_input_grad[1]:
                # dW = dy^T @ x: reduction over the M tokens; both operands blocked along M.
                gt, xt = g.t(), x.float().t()                               # (N, M), (K, M)
                if cfg.hadamard_wgrad:
                    h = mod._rotation(g.device)
                    gt, xt = _rotate(gt, h), _rotate(xt, h)
                gtq = quantize_operand(gt.contiguous(), cfg, grad=True, generator=gen).dequantize()
                xtq = quantize_operand(xt.contiguous(), cfg).dequantize()
                grad_w = (gtq @ xtq.t()).to(weight.dtype)                   # (N, K)
        return grad_x, grad_w, None
