"""``Fp8Linear``: an ``nn.Linear`` whose three GEMMs run in FP8 (and ``Fp8Conv1D``, the same for
Hugging Face's ``Conv1D``, GPT-2's transposed-weight Linear).

For ``y = x W^T`` (x: (M, K) tokens x in-features, W: (N, K)) training runs three GEMMs:

* forward        ``y  = x  @ W^T``  contraction over K (in-features),
* input grad     ``dx = dy @ W``    contraction over N (out-features),
* weight grad    ``dW = dy^T @ x``  contraction over M (tokens).

Every GEMM is written as ``A @ Bt^T`` with both operands row-major and quantized *along the
contraction dimension* (the layout FP8 tensor cores want). So ``dy`` is quantized twice (along N
for the input grad, along M for the weight grad), exactly as DeepSeek-V3 does. Per recipe:

==========  ==========================  ==========================
scaling     activations / gradients     weight
==========  ==========================  ==========================
tensorwise  one scale                   one scale
delayed     one scale (amax history)    one scale (amax history)
rowwise     one per row                 one per row
blockwise   1x128 tiles                 128x128 blocks
==========  ==========================  ==========================

The parameters are the original ``nn.Linear``'s (FP32 or BF16 master weights, never modified);
FP8 copies exist only inside a step. The high-precision input is saved for backward (as
``nn.Linear`` does) and re-quantized there along the other dimension.

Execution path, decided per call and never silently: ``cuda-scaled-mm`` (``torch._scaled_mm``
on a GPU with FP8 tensor cores), ``cpu-scaled-mm`` (PyTorch's CPU FP8 kernel, only when forced
with ``backend="scaled-mm"``) or ``emulated`` (see :mod:`mixprec.formats.emulation`). The module's
``execution_path`` and ``execution_reason`` say which ran last and why; every change of path is
logged at INFO level.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.errors import ConfigError
from mixprec.formats.fp8_config import Fp8Config
from mixprec.formats.emulation import emulated_mm
from mixprec.formats.fp8_quantize import Block, Fp8Tensor, compute_amax, quantize
from mixprec.policy import hardware

__all__ = ["Fp8Linear", "Fp8Conv1D", "is_conv1d", "fp8_gemm"]

log = logging.getLogger("mixprec.fp8")

_SLOTS = {"x": 0, "w": 1, "g": 2}  # rows of the delayed-scaling amax history


def _operand_block(config: Fp8Config, kind: str) -> Block:
    """Scale granularity of a GEMM operand laid out (rows, contraction)."""
    if config.scaling in ("tensorwise", "delayed"):
        return None
    if config.scaling == "rowwise":
        return (1, None)
    return config.weight_block if kind == "weight" else config.activation_block


class _Fp8Gemms:
    """What :class:`Fp8Linear` and :class:`Fp8Conv1D` share: the recipe, the amax history, the
    choice of execution path, and the quantization of one GEMM operand. The host class sets
    ``config``, ``fqn``, ``in_features`` and ``out_features`` (the GEMM's K and N)."""

    config: Fp8Config
    fqn: str
    in_features: int
    out_features: int

    def _init_fp8_state(self, config: Fp8Config | None, device: Any) -> None:
        self.config = config or Fp8Config.from_recipe("tensorwise")
        self.fqn = ""
        """Qualified name in the model (set by convert_to_fp8), used in logs and errors."""
        self.execution_path: str | None = None
        """``cuda-scaled-mm``, ``cpu-scaled-mm`` or ``emulated``: the path of the last call."""
        self.execution_reason: str = "not run yet"
        self._init_history(device)

    def _init_history(self, device: torch.device) -> None:
        # Non-persistent: FP8 and non-FP8 checkpoints of a model stay interchangeable; after a
        # resume the history refills within amax_history_len steps.
        hist = None
        if self.config.scaling == "delayed":
            hist = torch.zeros(3, self.config.amax_history_len, dtype=torch.float32, device=device)
        self.register_buffer("amax_history", hist, persistent=False)

    def _adopt(self, source: nn.Module, fqn: str):
        """Take ``source``'s weight and bias Parameters (built on "meta", nothing was allocated),
        its device for the amax history, its name and its train/eval mode; return self."""
        self.weight = source.weight
        self.bias = source.bias
        self._init_history(source.weight.device)
        self.fqn = fqn
        self.train(source.training)
        return self

    # --- path selection ------------------------------------------------------------------------

    def _choose_path(self, x: torch.Tensor) -> tuple[str, str]:
        cfg = self.config
        aligned = self.in_features % 16 == 0 and self.out_features % 16 == 0
        if cfg.backend == "emulated":
            return "emulated", "backend='emulated' requested"
        if cfg.backend == "scaled-mm":
            if not aligned:
                raise ConfigError(f"{type(self).__name__} '{self.fqn}' ({self.in_features}->"
                                  f"{self.out_features}) needs in/out features that are multiples "
                                  "of 16 for torch._scaled_mm; use backend='auto' or leave this "
                                  "layer unconverted")
            return f"{x.device.type}-scaled-mm", "backend='scaled-mm' requested"
        if x.device.type != "cuda":
            return "emulated", f"no FP8 GEMM hardware on {x.device.type} (emulation: numerics, not speed)"
        if not hardware.cuda_supports_fp8():
            return "emulated", "this GPU has no FP8 tensor cores (needs compute capability >= 8.9)"
        if cfg.limited_accumulation:
            return "emulated", "accum_mantissa_bits asks for accumulation emulation"
        if cfg.format == "e5m2":
            return "emulated", "torch._scaled_mm cannot multiply two E5M2 operands"
        if not aligned:
            return "emulated", "in/out features are not multiples of 16"
        return "cuda-scaled-mm", "FP8 tensor cores available"

    def _select_path(self, x: torch.Tensor) -> str:
        """The path of this call; every change of path is logged."""
        path, reason = self._choose_path(x)
        if path != self.execution_path:
            log.info("%s %s (%d->%d, %s): %s path (%s)", type(self).__name__, self.fqn or "<unnamed>",
                     self.in_features, self.out_features, self.config.recipe, path, reason)
            self.execution_path, self.execution_reason = path, reason
        return path

    def _fp8_matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x @ w^T`` in FP8 for ``x`` (..., K) and ``w`` (N, K) (a view is fine)."""
        path = self._select_path(x)
        lead = x.shape[:-1]
        out = _Fp8LinearFn.apply(x.reshape(-1, self.in_features), w, self, path)
        return out.reshape(*lead, self.out_features)

    # --- quantization of one operand -----------------------------------------------------------

    def _quantize(self, t: torch.Tensor, dtype: torch.dtype, kind: str, slot: str, *,
                  update_history: bool, what: str) -> Fp8Tensor:
        cfg = self.config
        amax = None
        if cfg.scaling == "delayed":
            hist = self.amax_history[_SLOTS[slot]]
            cur = compute_amax(t)
            past = hist.max() if cfg.amax_compute == "max" else hist[0]
            amax = torch.where(past > 0, past, cur)  # first step: no history yet, use the current amax
            if update_history:
                hist.copy_(torch.roll(hist, 1))
                hist[0] = torch.nan_to_num(cur, nan=0.0, posinf=0.0)
        return quantize(t, dtype, _operand_block(cfg, kind), margin=cfg.margin,
                        power_of_two=cfg.power_of_two_scales, amax=amax,
                        raise_on_nonfinite=cfg.nonfinite == "raise",
                        name=f"{type(self).__name__} '{self.fqn or '<unnamed>'}' {what}")


class Fp8Linear(_Fp8Gemms, nn.Linear):
    """``nn.Linear`` with FP8 forward, input-gradient and weight-gradient GEMMs (see module doc).

    Build one from an existing layer with :meth:`from_linear` (or convert a whole model with
    :func:`mixprec.fp8.convert_to_fp8`); the layer's ``weight``/``bias`` Parameters are reused.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 config: Fp8Config | None = None, device: Any = None, dtype: Any = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8_state(config, self.weight.device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: Fp8Config, *, fqn: str = "") -> "Fp8Linear":
        """An ``Fp8Linear`` sharing ``linear``'s Parameters (no copy, optimizer state stays valid)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  config=config, device="meta")
        return new._adopt(linear, fqn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._fp8_matmul(x, self.weight)                        # weight: (N, K)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, recipe={self.config.recipe}, "
                f"path={self.execution_path or 'not run yet'}")


def is_conv1d(module: nn.Module) -> bool:
    """A Hugging Face ``Conv1D`` (GPT-2's projections), recognised without importing transformers:
    a class named ``Conv1D`` with an ``nf`` attribute and a 2-D weight of shape ``(nx, nf)``, i.e.
    a Linear whose weight is stored transposed (``y = x @ weight + bias``)."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int)
            and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and weight.shape[1] == module.nf)


class Fp8Conv1D(_Fp8Gemms, nn.Module):
    """A Hugging Face ``Conv1D`` (``y = x @ weight + bias``, weight ``(nx, nf)`` = (in, out)) whose
    three GEMMs run in FP8, exactly as :class:`Fp8Linear`'s, with the weight read transposed.

    It keeps the original ``weight`` and ``bias`` Parameters in their original layout, so an
    optimizer built before the swap keeps stepping them, and ``state_dict`` keys and shapes stay
    those of ``Conv1D`` (a Hugging Face checkpoint loads into it, and ``save_pretrained`` output
    loads back into GPT-2). Not an ``nn.Linear``: its weight is not ``(out, in)``.
    """

    def __init__(self, nx: int, nf: int, *, config: Fp8Config | None = None,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.nx, self.nf = nx, nf
        self.in_features, self.out_features = nx, nf
        self.weight = nn.Parameter(torch.empty(nx, nf, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(nf, device=device, dtype=dtype))
        self._init_fp8_state(config, self.weight.device)

    @classmethod
    def from_conv1d(cls, conv: nn.Module, config: Fp8Config, *, fqn: str = "") -> "Fp8Conv1D":
        """An ``Fp8Conv1D`` sharing ``conv``'s Parameters (no copy, optimizer state stays valid)."""
        if not is_conv1d(conv):
            raise ConfigError(f"{type(conv).__name__} is not a Hugging Face Conv1D (weight (nx, nf))")
        nx, nf = conv.weight.shape
        return cls(nx, nf, config=config, device="meta")._adopt(conv, fqn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._fp8_matmul(x, self.weight.t())                    # (nx, nf) -> W (N, K)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return (f"nf={self.nf}, nx={self.nx}, recipe={self.config.recipe}, "
                f"path={self.execution_path or 'not run yet'}")


def _out_dtype(t: torch.Tensor) -> torch.dtype:
    dev = t.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return t.dtype


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, mod: _Fp8Gemms, path: str) -> torch.Tensor:
        cfg = mod.config
        out_dtype = _out_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            xq = mod._quantize(x, cfg.forward_dtype, "act", "x", update_history=True, what="input")
            wq = mod._quantize(weight, cfg.forward_dtype, "weight", "w", update_history=True,
                               what="weight")
            out = fp8_gemm(xq, wq, path=path, config=cfg, out_dtype=out_dtype)  # (M, N)
        ctx.save_for_backward(x, weight)
        ctx.mod, ctx.path = mod, path
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        mod, path = ctx.mod, ctx.path
        cfg = mod.config
        g = grad_out.contiguous()  # (M, N)
        grad_x = grad_w = None
        with torch.autocast(g.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                # dx = dy @ W: contraction over N; dy tiles run along N, W^T blocks (K, N).
                gq = mod._quantize(g, cfg.grad_dtype, "act", "g", update_history=True,
                                   what="output gradient")
                wtq = mod._quantize(weight.t(), cfg.forward_dtype, "weight", "w",
                                    update_history=False, what="weight")
                grad_x = fp8_gemm(gq, wtq, path=path, config=cfg, out_dtype=x.dtype)  # (M, K)
            if ctx.needs_input_grad[1]:
                if cfg.high_precision_wgrad:
                    grad_w = (g.float().t() @ x.float()).to(weight.dtype)  # (N, K) in FP32
                else:
                    # dW = dy^T @ x: contraction over the M tokens; both operands tiled along M.
                    gtq = mod._quantize(g.t(), cfg.grad_dtype, "act", "g",
                                        update_history=not ctx.needs_input_grad[0],
                                        what="output gradient")
                    xtq = mod._quantize(x.t(), cfg.forward_dtype, "act", "x",
                                        update_history=False, what="input")
                    grad_w = fp8_gemm(gtq, xtq, path=path, config=cfg, out_dtype=weight.dtype)
        return grad_x, grad_w, None, None


# --- the GEMM ----------------------------------------------------------------------------------

def fp8_gemm(a: Fp8Tensor, bt: Fp8Tensor, *, path: str, config: Fp8Config,
             out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ bt.T`` for FP8 ``a`` (M, K) and ``bt`` (N, K), in ``out_dtype``, on ``path``."""
    if path == "emulated":
        out = emulated_mm(a, bt, mantissa_bits=config.accum_mantissa_bits,
                          promotion_interval=config.promotion_interval, chunk=config.accum_chunk)
        return out.to(out_dtype)
    return _scaled_mm_gemm(a, bt, out_dtype)


def _pad_k(t: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    """Zero-pad the last dim of an FP8 matrix (byte 0 is +0.0 in both FP8 formats)."""
    pad = -t.shape[1] % multiple
    if not pad:
        return t
    return F.pad(t.view(torch.uint8), (0, pad)).view(t.dtype)


_ROWWISE_OUT_FALLBACK: set[str] = set()


def _rowwise_mm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """Rowwise-scaled ``torch._scaled_mm``; a: (M, K) row-major, b: (K, N) column-major,
    sa (M, 1), sb (1, N) FP32. Older CUTLASS kernels only emit BF16 for rowwise scaling: then the
    result comes back through BF16 and a warning says so once."""
    key = a.device.type
    if key not in _ROWWISE_OUT_FALLBACK or out_dtype == torch.bfloat16:
        try:
            return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
        except RuntimeError as e:
            if out_dtype == torch.bfloat16 or "bf16" not in str(e).lower() and \
                    "bfloat16" not in str(e).lower():
                raise
            _ROWWISE_OUT_FALLBACK.add(key)
            log.warning("torch._scaled_mm rowwise scaling cannot emit %s on this build; rowwise FP8 "
                        "GEMM results now pass through bf16 (%s)", out_dtype, e)
    return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16).to(out_dtype)


def _scaled_mm_gemm(a: Fp8Tensor, bt: Fp8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    M, N = a.shape[0], bt.shape[0]
    if a.block is None and bt.block is None:  # tensorwise: scalar FP32 scales
        ad, bd = _pad_k(a.data), _pad_k(bt.data)
        return torch._scaled_mm(ad, bd.t(), scale_a=a.scale.reshape(()).float(),
                                scale_b=bt.scale.reshape(()).float(), out_dtype=out_dtype)
    if a.block is None or bt.block is None:
        raise ConfigError("cannot mix a tensorwise operand with a blocked one in one FP8 GEMM")
    kb = a.block[1]
    if bt.block[1] != kb:
        raise ConfigError(f"blocked FP8 GEMM needs equal K-blocks for both operands, got {kb} "
                          f"and {bt.block[1]}")
    # One scale per (row, K-block) for each operand: (M, nk) and (N, nk).
    sa = a.scale if a.block[0] == 1 else a.scale.repeat_interleave(a.block[0], 0)[:M]
    sb = bt.scale if bt.block[0] == 1 else bt.scale.repeat_interleave(bt.block[0], 0)[:N]
    nk = sa.shape[1]
    if nk == 1:  # rowwise (or a single K-block): one GEMM
        return _rowwise_mm(_pad_k(a.data), _pad_k(bt.data).t(), sa.reshape(M, 1).contiguous(),
                           sb.reshape(1, N).contiguous(), out_dtype)
    # Blockwise: one rowwise-scaled FP8 GEMM per K-block, each promoted into an FP32 sum; this is
    # DeepSeek-V3's "promote every 128" done at GEMM level.
    out = torch.zeros(M, N, dtype=torch.float32, device=a.data.device)
    for j in range(nk):
        k0 = j * kb
        ad, bd = a.data[:, k0:k0 + kb], bt.data[:, k0:k0 + kb]  # strided views, no copy
        if ad.shape[1] % 16:  # ragged last block: pad (copies only this block)
            ad, bd = _pad_k(ad), _pad_k(bd)
        out += _rowwise_mm(ad, bd.t(), sa[:, j:j + 1].contiguous(),
                           sb[:, j].reshape(1, N).contiguous(), torch.float32)
    return out.to(out_dtype)
