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
FP8 copies exist only inside a step, except the weight's casts, which are reused while the weight
is unchanged (micro-batches of one optimizer step; ``Fp8Config.cache_weight_casts``).

Backward reuses the forward's casts wherever the scales allow, so each operand is cast as few
times as the recipe needs:

==========  =============================================  ===============================
scaling     casts per forward + backward                   saved for backward
==========  =============================================  ===============================
tensorwise  x, W, dy (the transposes are free: same scale)  FP8 x and W (not x in BF16)
rowwise     x, x^T, W, W^T, dy, dy^T (scales differ)        FP8 x^T and W^T
blockwise   x, x^T, W (128x128 blocks: W^T free), dy, dy^T   FP8 x^T and W
delayed     x, W, dy; then x^T, W^T, dy^T from the history   x and W (high precision)
            the first casts updated (the recipe's scales)
==========  =============================================  ===============================

(``x^T`` is cast along the token dimension in the forward, from ``x`` itself: no high-precision
transpose is ever made.)

Execution path, decided once (at conversion, or when the layer moves to another device) by
:mod:`mixprec.formats.fp8_path` and logged there in one line: ``cuda-scaled-mm``,
``cpu-scaled-mm`` (forced with ``backend="scaled-mm"``) or ``emulated``. ``execution_path`` and
``execution_reason`` say which and why; ``forward`` decides nothing.

Non-finite operands: every cast folds its scales into the layer's ``fp8_scale_max`` tensor (no host
read); the inf/NaN reaches the outputs or gradients computed from the hit block, so the step's
own gradient check skips the step; :func:`mixprec.formats.found_nonfinite` tells which layers (see
:mod:`mixprec.formats.fp8_nonfinite`). ``Fp8Config(nonfinite="raise")`` checks once per forward
and once per backward and names the operand.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from mixprec.errors import ConfigError
from mixprec.formats import fp8_cast
from mixprec.formats.fp8_config import Fp8Config
from mixprec.formats.fp8_gemm import fp8_gemm
from mixprec.formats.fp8_nonfinite import FLAG, TracksNonFinite
from mixprec.formats.fp8_operands import (Recipe, cast_operands, compiled_casts, operand_block,
                                          raise_if_nonfinite)
from mixprec.formats.fp8_path import GemmPlan, log_plan, plan_gemms
from mixprec.formats.fp8_quantize import Fp8Tensor

__all__ = ["Fp8Linear", "Fp8Conv1D", "is_conv1d", "fp8_gemm"]

_operand_block = operand_block  # the old private name, still imported by mixprec.plan

log = logging.getLogger(__name__)


class _Fp8Gemms(TracksNonFinite):
    """What :class:`Fp8Linear` and :class:`Fp8Conv1D` share: the recipe, the plan decided once,
    the amax history, the weight-cast cache and the non-finite flag. The host class sets
    ``config``, ``fqn``, ``in_features`` and ``out_features`` (the GEMM's K and N)."""

    fqn: str
    in_features: int
    out_features: int

    @property
    def config(self) -> Fp8Config:
        """The recipe. Assigning a new one is set-up: the path is decided again, then."""
        return self._config

    @config.setter
    def config(self, value: Fp8Config) -> None:
        self._config = value
        if "_plan" in self.__dict__:
            self._init_history(self.weight.device)
            self._decide(self.weight.device)

    def _init_fp8_state(self, config: Fp8Config | None, device: Any) -> None:
        self._config = config or Fp8Config.from_recipe("tensorwise")
        self.fqn = ""
        """Qualified name in the model (set by convert_to_fp8), used in logs and errors."""
        self._weight_cache: tuple | None = None
        self._init_history(device)
        self._init_nonfinite_flag(device)
        self._decide(device)

    def _init_history(self, device: torch.device) -> None:
        # Non-persistent: FP8 and non-FP8 checkpoints of a model stay interchangeable; after a
        # resume the history refills within amax_history_len steps.
        hist = None
        if self.config.scaling == "delayed":
            hist = torch.zeros(3, self.config.amax_history_len, dtype=torch.float32, device=device)
        self.register_buffer("amax_history", hist, persistent=False)

    def _adopt(self, source: nn.Module, fqn: str):
        """Take ``source``'s weight and bias Parameters (built on "meta", nothing was allocated),
        its device for the buffers, its name and its train/eval mode; decide the path; return self."""
        self.weight = source.weight
        self.bias = source.bias
        self._init_history(source.weight.device)
        self._init_nonfinite_flag(source.weight.device)
        self.fqn = fqn
        self.train(source.training)
        self._decide(source.weight.device)
        return self

    # --- the path, decided once ------------------------------------------------------------------

    def _decide(self, device: Any) -> None:
        """Ask :func:`~mixprec.formats.fp8_path.plan_gemms` once; log the one line when it changes."""
        old = getattr(self, "_plan", None)
        plan = plan_gemms(self.config, device, self.in_features, self.out_features,
                          owner=type(self).__name__, fqn=self.fqn)
        self._plan = plan
        self._recipe = Recipe(self.config, plan, type(self).__name__,
                               compiled_casts() if plan.compile_casts else fp8_cast.cast_group)
        self._weight_cache = None
        if torch.device(device if device is not None else "cpu").type != "meta" and \
                (old is None or old.path != plan.path or old.reason != plan.reason):
            log_plan(plan, type(self).__name__, self.fqn, self.in_features, self.out_features,
                     self.config.recipe)

    def _apply(self, fn, recurse: bool = True):
        # .to() / .cuda() is set-up too: a layer converted on the CPU and moved to a GPU gets the
        # GPU's path here, not in forward.
        before = self.weight.device
        out = super()._apply(fn, recurse)
        self._move_nonfinite_flag(fn)
        if self.weight.device != before:
            self._decide(self.weight.device)
        return out

    @property
    def execution_path(self) -> str:
        """``cuda-scaled-mm``, ``cpu-scaled-mm`` or ``emulated``: decided at conversion."""
        return self._plan.path

    @property
    def execution_reason(self) -> str:
        return self._plan.reason

    @property
    def gemm_plan(self) -> GemmPlan:
        """The whole decision (path, reason, probed GEMM facts)."""
        return self._plan

    def clear_fp8_cache(self) -> None:
        """Drop the cached weight casts (they are also dropped whenever the weight changes)."""
        self._weight_cache = None

    # --- the forward ----------------------------------------------------------------------------

    def _weight_operands(self, weight: torch.Tensor, transposed: bool, need_wt: bool):
        """The weight's FP8 operands (W along K; W^T along N where the recipe needs a second cast),
        cached while the weight is unchanged. ``weight`` is the Parameter; ``transposed``: it is
        stored (K, N) (Conv1D)."""
        cfg, rec = self.config, self._recipe
        cacheable = cfg.cache_weight_casts and cfg.scaling != "delayed" and \
            not torch.compiler.is_compiling()
        key = (weight._version, weight.data_ptr()) if cacheable else None
        cache = self._weight_cache
        flag, hist = getattr(self, FLAG), self.amax_history
        if key is not None and cache is not None and cache[0] is weight and cache[1] == key and \
                (cache[3] is not None or not need_wt):
            # a reused cast still reports a non-finite weight after the flags were reset (a
            # skipped step leaves the weight, hence its version, as it was)
            fp8_cast.fold_flag(flag, cache[2].scale)
            return cache[2], cache[3]
        with torch.no_grad():
            # Conv1D's weight is stored (K, N): W's rows (along K) are its columns.
            wd, kd = (0, 1) if transposed else (1, 0)
            ops = cast_operands(rec, weight, "weight", (wd, kd) if need_wt else (wd,), flag, hist,
                                "w", update_history=True)
            wq, wtq = ops[0], (ops[1] if need_wt else None)
        if key is not None:
            self._weight_cache = (weight, key, wq, wtq)
        return wq, wtq

    def _fp8_matmul(self, x: torch.Tensor, weight: torch.Tensor, transposed: bool = False) -> torch.Tensor:
        """``x @ W^T`` in FP8 for ``x`` (..., K); ``weight`` is W (N, K), or (K, N) when
        ``transposed`` (Conv1D)."""
        lead = x.shape[:-1]
        # W^T for the input gradient (delayed scaling casts it in the backward, see _Fp8LinearFn)
        need_wt = x.requires_grad and torch.is_grad_enabled() and self.config.scaling != "delayed"
        wq, wtq = self._weight_operands(weight, transposed, need_wt)
        w = weight.t() if transposed else weight
        out = _Fp8LinearFn.apply(x.reshape(-1, self.in_features), w, wq.data, wq.scale,
                                 None if wtq is None else wtq.data,
                                 None if wtq is None else wtq.scale,
                                 getattr(self, FLAG), self.amax_history, self._recipe,
                                 self.fqn, wq.block, None if wtq is None else wtq.block)
        return out.reshape(*lead, self.out_features)


class Fp8Linear(_Fp8Gemms, nn.Linear):
    """``nn.Linear`` with FP8 forward, input-gradient and weight-gradient GEMMs (see module doc).

    Build one from an existing layer with :meth:`from_linear` (or convert a whole model with
    :func:`mixprec.precision.convert_to_fp8`); the layer's ``weight``/``bias`` Parameters are reused.
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
                f"path={self.execution_path}")


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
        out = self._fp8_matmul(x, self.weight, transposed=True)       # (nx, nf) = W^T
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return (f"nf={self.nf}, nx={self.nx}, recipe={self.config.recipe}, "
                f"path={self.execution_path}")


def _out_dtype(t: torch.Tensor) -> torch.dtype:
    dev = t.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return t.dtype


def _gemm(rec: Recipe, a: Fp8Tensor, bt: Fp8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    plan = rec.plan
    return fp8_gemm(a, bt, path=plan.path, config=rec.config, out_dtype=out_dtype,
                    rowwise_out_fp32=plan.rowwise_out_fp32, block_layout=plan.block_layout,
                    block_kernel=plan.block_kernel)


class _Fp8LinearFn(torch.autograd.Function):
    """``y = x W^T`` with the weight's FP8 operands cast outside (cached) and passed in as tensors;
    everything else the layer knows arrives as plain values, so ``torch.compile`` traces it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, w_data: torch.Tensor,
                w_scale: torch.Tensor, wt_data: torch.Tensor | None, wt_scale: torch.Tensor | None,
                flag: torch.Tensor, hist: torch.Tensor | None, rec: Recipe, fqn: str,
                w_block: tuple[int, int] | None, wt_block: tuple[int, int] | None) -> torch.Tensor:
        cfg = rec.config
        out_dtype = _out_dtype(x)
        wq = Fp8Tensor(w_data, w_scale, w_block)
        need_wgrad = ctx.needs_input_grad[1]
        # Delayed scaling casts x^T and W^T in the backward, from the amax history the forward
        # updated (the recipe's scales): x and W are kept in high precision for it.
        delayed = cfg.scaling == "delayed"
        with torch.autocast(x.device.type, enabled=False):
            # x along K for the forward; x^T along the tokens for the weight gradient, cast now
            # from x itself (free for one scale; no high-precision transpose ever).
            want_xt = need_wgrad and not cfg.high_precision_wgrad and not delayed
            ops = cast_operands(rec, x, "act", (1, 0) if want_xt else (1,), flag, hist, "x",
                                update_history=True)
            xq, xtq = ops[0], (ops[1] if want_xt else None)
            if cfg.nonfinite == "raise":
                raise_if_nonfinite(rec, fqn, [("input", xq), ("weight", wq)])
            out = _gemm(rec, xq, wq, out_dtype)                                   # (M, N)
        saved: list[torch.Tensor | None] = [None] * 6
        if ctx.needs_input_grad[0]:
            saved[0], saved[1] = wt_data, wt_scale                               # W^T (K, N)
            if delayed:
                saved[5] = weight
        if need_wgrad:
            if cfg.high_precision_wgrad or delayed:
                saved[2] = x
            else:
                saved[3], saved[4] = xtq.data, xtq.scale                         # x^T (K, M)
                ctx.xt_block = xtq.block
        ctx.save_for_backward(*saved)
        ctx.rec, ctx.fqn, ctx.hist, ctx.flag = rec, fqn, hist, flag
        ctx.weight_dtype, ctx.x_dtype, ctx.wt_block = weight.dtype, x.dtype, wt_block
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        wt_data, wt_scale, x, xt_data, xt_scale, weight = ctx.saved_tensors
        rec, fqn, hist, flag = ctx.rec, ctx.fqn, ctx.hist, ctx.flag
        cfg = rec.config
        g = grad_out if grad_out.is_contiguous() else grad_out.contiguous()     # (M, N)
        grad_x = grad_w = None
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(g.device.type, enabled=False):
            # dx = dy @ W: contraction over N (dy along N, W^T (K, N) along N);
            # dW = dy^T @ x: contraction over the M tokens (dy^T and x^T along M).
            dims = ((1,) if need_dgrad else ()) + \
                ((0,) if need_wgrad and not cfg.high_precision_wgrad else ())
            ops = cast_operands(rec, g, "grad", dims, flag, hist, "g", update_history=True) \
                if dims else []
            gq = ops[0] if need_dgrad else None
            gtq = ops[-1] if 0 in dims else None
            named = [("output gradient", q) for q in ops]
            if cfg.scaling == "delayed":
                if need_dgrad:
                    (wtq,) = cast_operands(rec, weight, "weight", (0,), flag, hist, "w",
                                           update_history=False)
                    wt_data, wt_scale, ctx.wt_block = wtq.data, wtq.scale, wtq.block
                if need_wgrad and not cfg.high_precision_wgrad:
                    (xtq,) = cast_operands(rec, x, "act", (0,), flag, hist, "x",
                                           update_history=False)
                    xt_data, xt_scale, ctx.xt_block = xtq.data, xtq.scale, xtq.block
            if cfg.nonfinite == "raise" and named:
                raise_if_nonfinite(rec, fqn, named)
            if need_dgrad:
                wtq = Fp8Tensor(wt_data, wt_scale, ctx.wt_block)
                grad_x = _gemm(rec, gq, wtq, ctx.x_dtype)                           # (M, K)
            if need_wgrad:
                if cfg.high_precision_wgrad:
                    grad_w = (g.float().t() @ x.float()).to(ctx.weight_dtype)     # (N, K) in FP32
                else:
                    xtq = Fp8Tensor(xt_data, xt_scale, ctx.xt_block)
                    grad_w = _gemm(rec, gtq, xtq, ctx.weight_dtype)                # (N, K)
        return grad_x, grad_w, None, None, None, None, None, None, None, None, None, None
