"""``mixprec memory``: where the bytes of a training step go, per precision mode.

Seed 002's table (67B MoE: FP32 132 GB/GPU vs "FP16+FP32" 58 GB, -56 %) repeats a headline; this
estimator shows the parts. The rules it encodes:

* **States** (bytes per parameter): parameters in the param dtype, gradients in the param dtype,
  FP32 masters when the params are 16-bit, Adam's two moments (FP32, or BF16 as in DeepSeek-V3),
  and for 16-bit params the FP32 master gradients the optimizer steps on. With FP32 masters and
  FP32 Adam moments that is 16 bytes per parameter in *every* mode (4+4+8 with FP32 params;
  2+2+4+8 with 16-bit params, plus 4 of FP32 master gradients during the step). Mixed precision
  saves memory only on activations and, optionally, BF16 moments.
* **Activations** per layer per token, as saved for backward by mixprec's Transformer (counted
  with ``torch.autograd.graph.saved_tensors_hooks``; ``tests/bench/test_memory.py`` checks the
  formula against that count). With ``d`` the width, ``h`` heads, ``r`` the MLP ratio and ``c``
  the bytes of the compute dtype::

      4 * (2d + 4 + h)          FP32 in every mode: the two norm inputs (FP32 residual stream,
                                or the FP32 upcast inside the norm), their mean and 1/std, and
                                the attention log-sum-exp per head
    + c * (7 + 2r) * d          compute dtype: qkv input d, q/k/v 3d, attention output d, its
                                (B,T,C) copy d, MLP input d, GELU input r*d, GELU output r*d

  i.e. ``68d + 4h + 16`` bytes in FP32 and ``38d + 4h + 16`` in BF16 (r = 4): activations shrink
  by ~44 %, not 50 %, because norms keep FP32. With activation checkpointing a layer keeps only
  its input (``d`` in the residual dtype), and one layer's full activations exist during its
  recompute. An MoE MLP keeps ``top_k`` experts' worth of the MLP term per token.
  The head adds the final norm, the logits' log-softmax (FP32, ``4V`` per token) and, while the
  loss backward starts, two more FP32 ``V``-wide buffers. While a block runs backward, gradients
  shaped like its saved tensors exist next to them: one more block's worth (measured: the
  peak RSS exceeds the saved tensors by one block, 15-84 MiB for the small model at 2-8k tokens).
* **Autocast weight copies**: under ``*-mixed`` each matmul weight is cast to the compute dtype
  once per step and kept for backward (``c`` bytes per matmul parameter).

Peak = parameters + masters + moments + max(activation phase, gradient/optimizer phase), where the
activation phase is weight copies + activations + the larger of the loss and block-backward buffers.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import torch

from mixprec.errors import ConfigError

__all__ = ["ModelShape", "MemoryEstimate", "estimate_memory", "activation_bytes_per_token",
           "MOE_67B", "format_table", "configure", "run"]

GB = 1e9


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes the estimate needs (a :class:`mixprec.models.TransformerConfig` maps onto it)."""

    num_layers: int
    """Transformer blocks."""
    d_model: int
    """Residual width."""
    num_heads: int
    """Attention heads."""
    vocab_size: int
    """Output classes of the head."""
    max_seq_len: int = 1024
    """Rows of the learned position embedding."""
    mlp_ratio: int = 4
    """MLP hidden width / d_model (per expert for MoE)."""
    num_experts: int = 0
    """0: dense MLPs; >0 experts per block."""
    top_k: int = 2
    """Experts per token (MoE)."""
    tie_embeddings: bool = True
    """Head shares the token embedding."""
    bias: bool = True
    """Linear and norm biases."""

    def __post_init__(self) -> None:
        for f in ("num_layers", "d_model", "num_heads", "vocab_size", "max_seq_len", "mlp_ratio"):
            if getattr(self, f) < 1:
                raise ConfigError(f"{f} must be >= 1, got {getattr(self, f)}")
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"top_k must be in [1, {self.num_experts}], got {self.top_k}")

    @classmethod
    def from_config(cls, cfg) -> "ModelShape":
        return cls(num_layers=cfg.num_layers, d_model=cfg.d_model, num_heads=cfg.num_heads,
                   vocab_size=cfg.vocab_size, max_seq_len=cfg.max_seq_len, mlp_ratio=cfg.mlp_ratio,
                   num_experts=cfg.num_experts, top_k=cfg.top_k, tie_embeddings=cfg.tie_embeddings,
                   bias=cfg.bias)

    # --- parameter counts (exactly those of mixprec.models.Transformer) ------------------------

    def _mlp_params(self) -> int:
        d, hid = self.d_model, self.mlp_ratio * self.d_model
        return 2 * d * hid + (hid + d if self.bias else 0)

    def layer_matmul_weights(self) -> int:
        """Matmul weights of one block (attention + all experts, or the MLP; router included)."""
        d, hid = self.d_model, self.mlp_ratio * self.d_model
        attn = 4 * d * d
        mlp = 2 * d * hid * max(1, self.num_experts) + (d * self.num_experts if self.num_experts else 0)
        return attn + mlp

    def layer_params(self) -> int:
        d = self.d_model
        b = self.bias
        norms = 2 * (2 * d if b else d)
        attn = 4 * d * d + (4 * d if b else 0)
        if self.num_experts:
            mlp = self.num_experts * self._mlp_params() + d * self.num_experts + (self.num_experts if b else 0)
        else:
            mlp = self._mlp_params()
        return norms + attn + mlp

    def num_parameters(self) -> int:
        d = self.d_model
        emb = self.vocab_size * d + self.max_seq_len * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        final_norm = 2 * d if self.bias else d
        return emb + head + final_norm + self.num_layers * self.layer_params()

    def matmul_weights(self) -> int:
        """Parameters that autocast casts to the compute dtype (Linear weights and the head)."""
        return self.num_layers * self.layer_matmul_weights() + self.vocab_size * self.d_model


MOE_67B = ModelShape(num_layers=30, d_model=4096, num_heads=32, vocab_size=102400, max_seq_len=4096,
                     mlp_ratio=4, num_experts=16, top_k=2, tie_embeddings=False, bias=False)
"""A ~67B-parameter MoE (seed 002's "670亿参数MoE"): 30 blocks of d=4096 with 16 experts, top-2."""

_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def activation_bytes_per_token(shape: ModelShape, compute_bytes: int, *, residual_bytes: int = 4,
                               checkpointing: bool = False) -> tuple[float, float]:
    """(bytes kept per token by one block, bytes of one block during its recompute or 0).

    See the module docstring for the derivation; ``residual_bytes`` is what a checkpointed block
    keeps of its input (4 in 32-true and *-mixed, 2 in the 16-bit "true" modes).
    """
    d, h, r = shape.d_model, shape.num_heads, shape.mlp_ratio
    mlp_copies = shape.top_k if shape.num_experts else 1
    fp32_part = 4 * (2 * d + 4 + h)
    low_part = compute_bytes * (5 * d + mlp_copies * (1 + 2 * r) * d)
    full = fp32_part + low_part
    if checkpointing:
        return residual_bytes * d, full
    return full, 0.0


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device of one training step (see the module docstring)."""

    mode: str
    parameters: float
    gradients: float
    master_weights: float
    master_gradients: float
    optimizer_moments: float
    weight_copies: float
    activations: float
    loss_buffers: float
    backward_buffers: float
    optimizer_scratch: float

    @property
    def states(self) -> float:
        """Parameters, gradients, masters and moments: seed 002's "parameter storage" (16 bytes per
        parameter with FP32 masters and Adam). FP32 master gradients, alive only around the
        optimizer step, are counted in :attr:`peak`."""
        return self.parameters + self.gradients + self.master_weights + self.optimizer_moments

    @property
    def peak(self) -> float:
        resident = self.parameters + self.master_weights + self.optimizer_moments
        forward_end = self.weight_copies + self.activations + max(self.loss_buffers, self.backward_buffers)
        step = self.gradients + self.master_gradients + self.optimizer_scratch
        return resident + max(forward_end, step)


def estimate_memory(shape: ModelShape, precision: str, *, batch: int, seq: int, optimizer: str = "adamw",
                    moments_dtype: str = "fp32", checkpointing: bool = False, shards: int = 1) -> MemoryEstimate:
    """Bytes per device of a training step of ``shape`` under ``precision``.

    ``batch`` is the micro-batch per device; ``shards`` > 1 divides every state (parameters,
    gradients, masters, moments) as FSDP / ZeRO-3 does; activations are per device.
    """
    from mixprec.engine import Precision
    from mixprec.precision.dtypes import parse_dtype
    policy = precision if isinstance(precision, Precision) else Precision(precision)
    if optimizer not in ("adamw", "sgd"):
        raise ConfigError(f"--optimizer must be adamw or sgd, got '{optimizer}'")
    if batch < 1 or seq < 1 or shards < 1:
        raise ConfigError("--batch, --seq and --gpus must be >= 1")
    mdt = parse_dtype(moments_dtype)
    if mdt not in (torch.float32, torch.bfloat16):
        raise ConfigError(f"--moments-dtype must be fp32 or bf16, got '{moments_dtype}'")
    P = shape.num_parameters()
    norm_params = shape.num_layers * 2 * (2 if shape.bias else 1) * shape.d_model + \
        (2 if shape.bias else 1) * shape.d_model     # kept FP32 by every policy
    low_p = P - norm_params
    pb, cb = _BYTES[policy.param_dtype], _BYTES[policy.compute_dtype]
    params = low_p * pb + norm_params * 4
    grads = params
    masters = low_p * 4 if policy.keeps_masters else 0
    master_grads = masters
    per_moment = _BYTES[mdt]
    moments = (2 * per_moment * P) if optimizer == "adamw" else 4 * P    # SGD: momentum buffer
    # torch's foreach AdamW holds one FP32 temporary list the size of the params during its
    # update (sqrt of the second moment); mixprec's AdamW works in bounded chunks.
    scratch = 4 * P if optimizer == "adamw" else 0
    copies = shape.matmul_weights() * cb if policy.autocast_copies_weights else 0
    tokens = batch * seq
    residual = pb if policy.stores_low_precision else 4
    kept, recompute = activation_bytes_per_token(shape, cb, residual_bytes=residual, checkpointing=checkpointing)
    d, V = shape.d_model, shape.vocab_size
    head = 4 * (d + 2) + cb * d + 4 * V + 8          # final norm, head input, log-softmax, token ids
    acts = tokens * (shape.num_layers * kept + recompute + head)
    loss_buffers = tokens * (8 * V + (cb * V if cb < 4 else 0))
    # A block's backward materialises gradients shaped like its saved tensors before it frees them.
    backward_buffers = tokens * (recompute or kept)
    s = float(shards)
    return MemoryEstimate(mode=policy.name, parameters=params / s, gradients=grads / s,
                          master_weights=masters / s, master_gradients=master_grads / s,
                          optimizer_moments=moments / s, weight_copies=copies / s, activations=float(acts),
                          loss_buffers=float(loss_buffers), backward_buffers=float(backward_buffers),
                          optimizer_scratch=scratch / s)


def format_table(rows: list[MemoryEstimate], *, unit: float = GB, unit_name: str = "GB") -> str:
    """Seed 002's columns (per device, parameter storage, activations, saving vs FP32), then
    the breakdown the seed leaves out."""
    base = next((r for r in rows if r.mode == "32-true"), rows[0])
    out = [f"{'mode':<12} {'per device':>11} {'param+optim':>12} {'activations':>12} {'saving':>8}"
           f"   (in {unit_name}; saving of the per-device peak vs {base.mode})"]
    for r in rows:
        out.append(f"{r.mode:<12} {r.peak / unit:>11.2f} {r.states / unit:>12.2f} "
                   f"{(r.activations + r.loss_buffers) / unit:>12.2f} {1 - r.peak / base.peak:>7.0%}")
    out.append("")
    out.append(f"{'breakdown':<12} " + " ".join(f"{n:>10}" for n in (
        "params", "grads", "masters", "mgrads", "moments", "w.copies", "acts", "loss", "opt.tmp")))
    for r in rows:
        vals = (r.parameters, r.gradients, r.master_weights, r.master_gradients, r.optimizer_moments,
                r.weight_copies, r.activations, r.loss_buffers, r.optimizer_scratch)
        out.append(f"{r.mode:<12} " + " ".join(f"{v / unit:>10.2f}" for v in vals))
    return "\n".join(out)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="small",
                        help="model preset (tiny, small, gpt-ref) or moe-67b (seed 002's 67B MoE)")
    parser.add_argument("--precision", default="32-true,bf16-mixed,bf16-true",
                        help="comma-separated precision modes")
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    parser.add_argument("--moments-dtype", default="fp32", help="Adam moments: fp32 or bf16")
    parser.add_argument("--batch", type=int, default=16, help="micro-batch per device")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sample (default: model max)")
    parser.add_argument("--checkpointing", action="store_true", help="activation recompute per block")
    parser.add_argument("--gpus", type=int, default=1, help="devices the states are sharded over (FSDP)")
    parser.add_argument("--params", type=float, default=None,
                        help="target total parameters (e.g. 67e9): sets the number of layers")
    parser.add_argument("--moe", type=int, default=None, help="experts per block (0: dense)")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--d-model", type=int, default=None)


def _shape_from_args(args: argparse.Namespace) -> ModelShape:
    if args.model == "moe-67b":
        shape = MOE_67B
    else:
        from mixprec.errors import ConfigError, closest
        from mixprec.models.config import MODEL_PRESETS, get_model_config
        if args.model.strip().lower() not in MODEL_PRESETS:
            valid = [*MODEL_PRESETS, "moe-67b"]
            raise ConfigError(f"unknown model '{args.model}'{closest(args.model, valid)}; valid: "
                              f"{', '.join(valid)}")
        shape = ModelShape.from_config(get_model_config(args.model))
    changes = {k: v for k, v in (("num_experts", args.moe), ("num_layers", args.layers),
                                 ("d_model", args.d_model)) if v is not None}
    if changes:
        shape = dataclasses.replace(shape, **changes)
    if args.params:
        one = dataclasses.replace(shape, num_layers=1)
        fixed = one.num_parameters() - one.layer_params()
        layers = max(1, round((args.params - fixed) / one.layer_params()))
        shape = dataclasses.replace(shape, num_layers=layers)
    return shape


def run(args: argparse.Namespace) -> int:
    shape = _shape_from_args(args)
    seq = args.seq or shape.max_seq_len
    modes = [m.strip() for m in args.precision.split(",") if m.strip()]
    rows = [estimate_memory(shape, m, batch=args.batch, seq=seq, optimizer=args.optimizer,
                            moments_dtype=args.moments_dtype, checkpointing=args.checkpointing,
                            shards=args.gpus) for m in modes]
    big = rows[0].peak > 1e9
    n = shape.num_parameters()
    print(f"model: {f'{n / 1e9:.2f}B' if n >= 1e9 else f'{n / 1e6:.2f}M'} parameters ({shape.num_layers} layers, d={shape.d_model}"
          f"{f', {shape.num_experts} experts top-{shape.top_k}' if shape.num_experts else ''}); "
          f"batch {args.batch} x {seq} per device; {args.gpus} device(s); optimizer {args.optimizer} "
          f"(moments {args.moments_dtype}); checkpointing {'on' if args.checkpointing else 'off'}")
    print(format_table(rows, unit=GB if big else 2**20, unit_name="GB" if big else "MiB"))
    return 0
