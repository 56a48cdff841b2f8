"""``mixprec estimate``: memory, time, energy and cost of a run on a cluster (:mod:`mixprec.estimate.cluster`)."""
from __future__ import annotations

import argparse
from mixprec.cli.flags import add_batch_size, add_seq_len
from mixprec.errors import ConfigError
from mixprec.estimate.gpus import GPUS
from mixprec.estimate.cluster import ( ModelSpec, estimate, format_count, format_estimates, parse_count,
                                     resolve_model)

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model (one of)")
    g.add_argument("--model", default=None, help="preset (tiny, small, gpt-ref, moe-67b) or a Hugging Face "
                   "config.json path (read, never downloaded)")
    g.add_argument("--params", default=None, help="total parameters, e.g. 671B (with --active-params for MoE)")
    g.add_argument("--active-params", default=None, help="parameters used per token (MoE), e.g. 37B")
    g.add_argument("--layers", type=int, default=None, help="with --params: layers, for the attention FLOPs")
    g.add_argument("--hidden", type=int, default=None, help="with --params: width, for the attention FLOPs")
    r = parser.add_argument_group("run")
    r.add_argument("--tokens", default=None, help="training token budget, e.g. 14.8T (required)")
    r.add_argument("--gpu", default="H800", help=f"{', '.join(GPUS)}, or cpu (this machine's measured peak)")
    r.add_argument("--gpus", type=int, default=8, help="number of GPUs")
    r.add_argument("--precision", default="bf16-mixed", help="precision mode (a mixprec policy name)")
    r.add_argument("--compare", default=None, help="comma-separated modes side by side (overrides --precision)")
    r.add_argument("--mfu", type=float, default=0.4, help="assumed or measured model-FLOPs utilisation, (0, 1]")
    r.add_argument("--peak-tflops", type=float, default=None, help="override the per-GPU dense peak")
    r.add_argument("--global-batch", default=None, help="tokens per optimizer step, for the step time (default: "
                   "4Mi, or one micro-batch per data-parallel rank if that is more)")
    add_seq_len(r, default=None, help="tokens per sequence (default: the model's: a preset's "
                "max_seq_len, a config.json's max_position_embeddings / n_positions / n_ctx, else 4096)")
    add_batch_size(r, default=1, help="sequences per GPU per forward (the micro-batch; memory)",
                   old=("--micro-batch",))
    r.add_argument("--parallelism", default="fsdp", help="ddp (states replicated) or fsdp (sharded over dp)")
    r.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    r.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    r.add_argument("--checkpointing", action="store_true", help="activation recompute per block")
    r.add_argument("--moments-dtype", default="fp32", help="Adam moments: fp32 or bf16")
    r.add_argument("--no-attention-flops", dest="attention_flops", action="store_false",
                   help="count 6*N per token only")
    c = parser.add_argument_group("energy and cost")
    c.add_argument("--power-w", type=float, default=None, help="mean draw per GPU in W (default: its TDP)")
    c.add_argument("--pue", type=float, default=1.2, help="power usage effectiveness of the data centre")
    c.add_argument("--usd-per-gpu-hour", type=float, default=2.0, help="rental price per GPU-hour")


def _model_from_args(args: argparse.Namespace) -> ModelSpec:
    if args.params is not None:
        if args.model is not None:
            raise ConfigError("give either --model or --params/--active-params, not both")
        total = parse_count(args.params, "--params")
        active = parse_count(args.active_params, "--active-params") if args.active_params else total
        if not 0 < active <= total:
            raise ConfigError(f"--active-params must be in (0, --params], got {active:g} of {total:g}")
        coef = 6.0 * args.layers * args.hidden if args.layers and args.hidden else 0.0
        return ModelSpec(name=f"{format_count(total)} total / {format_count(active)} active (explicit)", total_params=total,
                         active_params=active, attention_coef=coef)
    if args.active_params is not None:
        raise ConfigError("--active-params needs --params (the total)")
    return resolve_model(args.model or "small")


def run(args: argparse.Namespace) -> int:
    if args.tokens is None:
        raise ConfigError("--tokens is required: the training token budget, e.g. --tokens 14.8T")
    spec = _model_from_args(args)
    modes = [m.strip() for m in (args.compare or args.precision).split(",") if m.strip()]
    if not modes:
        raise ConfigError("--compare needs at least one precision mode")
    rows = [estimate(spec, tokens=args.tokens, gpu=args.gpu, num_gpus=args.gpus, precision=m, mfu=args.mfu,
                     global_batch_tokens=args.global_batch, seq=args.seq_len, micro_batch=args.batch_size,
                     parallelism=args.parallelism.strip().lower(), tp=args.tp, pp=args.pp,
                     checkpointing=args.checkpointing, moments_dtype=args.moments_dtype,
                     peak_tflops=args.peak_tflops, power_w=args.power_w, pue=args.pue,
                     usd_per_gpu_hour=args.usd_per_gpu_hour, attention_flops=args.attention_flops)
            for m in modes]
    where = "--seq-len" if args.seq_len else spec.seq_source
    print(f"sequence length: {rows[0].seq} tokens ({where})")
    print(format_estimates(rows))
    if args.gpu.strip().lower() == "cpu" and args.peak_tflops is None:   # a measured peak: whose?
        from mixprec.policy.peak import format_peak_source
        from mixprec.precision import Precision
        for fmt in dict.fromkeys(Precision(m).layers.peak_format for m in modes):
            print(f"{fmt.upper()} peak of this CPU: {format_peak_source(fmt, 'cpu')}")
    return 0
