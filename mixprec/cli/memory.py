"""``mixprec memory``: the memory estimate per precision mode (:mod:`mixprec.estimate.memory`)."""
from __future__ import annotations

import argparse
import dataclasses

from mixprec.cli.flags import add_batch_size, add_seq_len
from mixprec.estimate.memory import GB, ModelShape, estimate_memory, format_table

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="model preset (tiny, small, gpt-ref), moe-67b (the 67B MoE of "
                             "docs/sources.md) or a Hugging Face config.json path (read, never "
                             "downloaded), as for `mixprec estimate`; default small")
    parser.add_argument("--precision", default="32-true,bf16-mixed,bf16-true",
                        help="comma-separated precision modes")
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"),
                        help="adamw: two moments per parameter; sgd: none")
    parser.add_argument("--moments-dtype", "--moments", default="fp32",
                        help="Adam moments: fp32, bf16, int8, fp8 or fp8-e5m2 (mixprec.optim.moments)")
    parser.add_argument("--fp8-activations", action="store_true",
                        help="Linear inputs saved for backward in FP8 (mixprec.nn.fp8_activations)")
    parser.add_argument("--device", default=None, choices=("cpu",),
                        help="cpu: the estimate for this CPU (short 16-bit attention runs in FP32 "
                             "without AMX); default: the 16-bit kernels, as on GPUs")
    parser.add_argument("--full-masters", action="store_true",
                        help="full FP32 masters and master gradients (split_masters=false) instead of "
                             "mixprec's default split masters (BF16 parameter + 16-bit remainder)")
    add_batch_size(parser, default=16, help="sequences per device per forward (the micro-batch)",
                   old=("--batch",))
    add_seq_len(parser, default=None, help="tokens per sequence (default: the model's: a preset's "
                "max_seq_len, a config.json's max_position_embeddings / n_positions / n_ctx)")
    parser.add_argument("--checkpointing", action="store_true", help="activation recompute per block")
    parser.add_argument("--loss-chunk", type=int, default=0, metavar="TOKENS",
                        help="the loss computed TOKENS tokens at a time (Transformer.loss_chunk; default 0: off)")
    parser.add_argument("--gpus", type=int, default=1, help="devices the states are sharded over (FSDP)")
    parser.add_argument("--params", default=None,
                        help="target total parameters (e.g. 7B, 67e9, as for `mixprec estimate`): with "
                             "--model or --d-model sets the number of layers (that model, deeper), "
                             "with --layers the width, else both (d_model = 128 x layers, as GPT-3)")
    parser.add_argument("--moe", type=int, default=None, help="experts per block (0: dense)")
    parser.add_argument("--overrides", default=None, metavar="PATTERN=FORMAT,...",
                        help="per-layer formats applied to every mode, e.g. 'blocks.0.*=fp32,head=bf16'")
    parser.add_argument("--layers", type=int, default=None, help="number of blocks (default: the model's)")
    parser.add_argument("--d-model", type=int, default=None, help="residual width (default: the model's)")


def _shape_from_args(args: argparse.Namespace) -> tuple[ModelShape, str]:
    """The model's shape and where its default sequence length comes from."""
    from mixprec.estimate.cluster import resolve_model   # presets, moe-67b and config.json: one loader
    spec = resolve_model(args.model or "small")
    shape = spec.shape
    if args.moe is not None:
        shape = dataclasses.replace(shape, num_experts=args.moe)
    if args.params is not None:             # one parser with `mixprec estimate --params`
        from mixprec.estimate.cluster import parse_count
        from mixprec.estimate.sizing import shape_for_params
        return shape_for_params(shape, parse_count(args.params, "--params"), layers=args.layers,
                                d_model=args.d_model, keep_width=args.model is not None), spec.seq_source
    changes = {k: v for k, v in (("num_layers", args.layers), ("d_model", args.d_model)) if v is not None}
    if changes:
        shape = dataclasses.replace(shape, **changes)
    return shape, spec.seq_source


def run(args: argparse.Namespace) -> int:
    shape, seq_source = _shape_from_args(args)
    seq = args.seq_len or shape.max_seq_len
    modes = [m.strip() for m in args.precision.split(",") if m.strip()]
    if getattr(args, "overrides", None):
        from mixprec.precision import Precision
        modes = [Precision(m, overrides=args.overrides) for m in modes]
    rows = [estimate_memory(shape, m, batch=args.batch_size, seq=seq, optimizer=args.optimizer,
                            moments_dtype=args.moments_dtype, checkpointing=args.checkpointing,
                            shards=args.gpus, split_masters=not args.full_masters,
                            device=args.device, fp8_activations=args.fp8_activations,
                            loss_chunk=args.loss_chunk) for m in modes]
    big = rows[0].peak > 1e9
    n = shape.num_parameters()
    print(f"model: {f'{n / 1e9:.2f}B' if n >= 1e9 else f'{n / 1e6:.2f}M'} parameters ({shape.num_layers} layers, d={shape.d_model}"
          f"{f', {shape.num_experts} experts top-{shape.top_k}' if shape.num_experts else ''}); "
          f"batch {args.batch_size} x {seq} per device (sequence length: "
          f"{'--seq-len' if args.seq_len else seq_source}); {args.gpus} device(s); optimizer {args.optimizer} "
          f"(moments {args.moments_dtype}); masters {'full FP32' if args.full_masters else 'split'}; "
          f"checkpointing {'on' if args.checkpointing else 'off'}"
          + (f"; loss in slices of {args.loss_chunk} tokens" if args.loss_chunk else ""))
    print(format_table(rows, unit=GB if big else 2**20, unit_name="GB" if big else "MiB"))
    return 0
