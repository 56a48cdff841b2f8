"""``mixprec estimate``: memory, time, energy and cost of a training run, before running it.

The arithmetic, all of it (no hidden factors)::

    FLOPs per token  = 6 * N_active + 3 * L * h * (d_qk + d_v) * T       (training: forward + backward)
    step time        = global_batch_tokens * FLOPs per token / (gpus * peak * MFU)
    run time         = tokens * FLOPs per token / (gpus * peak * MFU)
    GPU-hours        = gpus * run time / 3600
    energy           = GPU-hours * power per GPU * PUE
    cost             = GPU-hours * price per GPU-hour

``N_active`` counts the parameters a token's forward pass multiplies with (for an MoE, only its
``top_k`` routed experts and the shared ones; the embedding look-up is free, the head is not), 2
FLOPs each forward and 4 backward. The attention term is ``q @ k^T`` and ``probs @ v`` over ``T``
keys, halved for the causal mask; it is what ``Transformer.flops_per_token`` counts, so a measured
MFU from ``mixprec train`` can be fed back here. ``peak`` is the dense datasheet rate of the format
the mode's GEMMs run in (``mixprec.estimate.gpus``); for the ``fp8-*`` modes the attention matmuls
really run in BF16, so an MFU quoted against the FP8 peak is the whole step's. Memory per GPU is
``mixprec memory``'s estimator (:func:`mixprec.estimate.memory.estimate_memory`).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from mixprec.estimate.gpus import get_gpu, peak_kind
from mixprec.estimate.memory import GB, MOE_67B, MemoryEstimate, ModelShape, estimate_memory
from mixprec.errors import ConfigError, closest

__all__ = ["ModelSpec", "Estimate", "estimate", "model_from_hf_config", "parse_count", "format_estimates",
           "resolve_model", "format_count"]

PARALLELISMS = ("ddp", "fsdp")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What the estimate needs to know of a model."""

    name: str
    total_params: float
    """All parameters (what the optimizer states scale with)."""
    active_params: float
    """Parameters one token's forward pass uses: the ``N`` of ``6 * N`` FLOPs per token."""
    attention_coef: float = 0.0
    """Attention FLOPs per token = ``attention_coef * seq`` (``3 * L * h * (d_qk + d_v)``)."""
    shape: ModelShape | None = None
    """The layer shapes, for the activation memory (None: states only)."""
    default_seq: int = 4096
    """Sequence length when none is given."""
    seq_source: str = "assumed"
    """Where ``default_seq`` comes from, for the printed line (``max_position_embeddings of
    config.json``, ``the preset's max_seq_len``, or ``assumed``)."""

    @classmethod
    def from_shape(cls, name: str, shape: ModelShape, *, head_dims: tuple[int, int] | None = None,
                   default_seq: int | None = None, seq_source: str | None = None) -> "ModelSpec":
        hd = shape.d_model // shape.num_heads
        d_qk, d_v = head_dims or (hd, hd)
        return cls(name=name, total_params=shape.num_parameters(), active_params=shape.active_parameters(),
                   attention_coef=3.0 * shape.num_layers * shape.num_heads * (d_qk + d_v), shape=shape,
                   default_seq=default_seq or shape.max_seq_len,
                   seq_source=seq_source or ("assumed" if default_seq else f"max_seq_len of preset {name}"))


def _preset(name: str) -> ModelSpec:
    if name == "moe-67b":
        return ModelSpec.from_shape(name, MOE_67B)
    from mixprec.models.config import MODEL_PRESETS
    cfg = MODEL_PRESETS[name]
    return ModelSpec.from_shape(name, ModelShape.from_config(cfg))


SEQ_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length",
            "max_sequence_length")
"""Hugging Face config keys that give the model's sequence length, first found wins."""


def model_from_hf_config(path: str | Path) -> ModelSpec:
    """A :class:`ModelSpec` from a Hugging Face ``config.json`` (a file, or a folder holding one).

    Read: ``hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
    intermediate_size, vocab_size, tie_word_embeddings, hidden_act``; MoE fields
    ``n_routed_experts | num_local_experts | num_experts, num_experts_per_tok, moe_intermediate_size,
    n_shared_experts | shared_expert_intermediate_size, first_k_dense_replace``; DeepSeek's latent
    attention (``q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim``).
    Rotary positions and no biases are assumed; ``silu``/``swish`` activations mean a gated MLP.
    Multi-token-prediction modules (``num_nextn_predict_layers``) are not counted. The default
    sequence length is the first of :data:`SEQ_KEYS` the config holds (4096 when none).
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"no config.json at '{path}'")
    try:
        cfg = json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p} is not valid JSON ({e})") from None
    if isinstance(cfg.get("text_config"), dict):                   # multimodal wrappers
        cfg = {**cfg, **cfg["text_config"]}

    def need(key: str) -> int:
        if not isinstance(cfg.get(key), int) or cfg[key] < 1:
            raise ConfigError(f"{p} has no positive integer '{key}': mixprec reads decoder language-model "
                              "configs (hidden_size, num_hidden_layers, num_attention_heads, vocab_size, "
                              "intermediate_size)")
        return cfg[key]

    d, L, h, V, hid = (need(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                         "vocab_size", "intermediate_size"))
    if cfg.get("kv_lora_rank"):                                    # multi-head latent attention
        qr, kvr = cfg.get("q_lora_rank") or 0, cfg["kv_lora_rank"]
        nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        q = d * qr + qr + qr * h * (nope + rope) if qr else d * h * (nope + rope)   # + its norm
        attn = q + d * (kvr + rope) + kvr + kvr * h * (nope + vd) + h * vd * d
        d_qk, d_v = nope + rope, vd
    else:
        kv = cfg.get("num_key_value_heads") or h
        hd = cfg.get("head_dim") or d // h
        attn = 2 * d * h * hd + 2 * d * kv * hd                    # q and o; k and v (grouped)
        d_qk = d_v = hd
    experts = next((cfg[k] for k in ("n_routed_experts", "num_local_experts", "num_experts")
                    if cfg.get(k)), 0)
    ehid = cfg.get("moe_intermediate_size") or hid
    shared = cfg.get("n_shared_experts") or (round(cfg["shared_expert_intermediate_size"] / ehid)
                                             if cfg.get("shared_expert_intermediate_size") else 0)
    act = str(cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu").lower()
    seq_key = next((k for k in SEQ_KEYS if isinstance(cfg.get(k), int) and cfg[k] > 0), None)
    seq = cfg[seq_key] if seq_key else 4096
    shape = ModelShape(num_layers=L, d_model=d, num_heads=h, vocab_size=V,
                       max_seq_len=seq, mlp_hidden=hid,
                       expert_hidden=ehid if experts else 0, gated_mlp=act in ("silu", "swish", "swiglu"),
                       num_experts=experts, top_k=(cfg.get("num_experts_per_tok") or 2) if experts else 2,
                       shared_experts=shared if experts else 0,
                       dense_layers=(cfg.get("first_k_dense_replace") or 0) if experts else 0,
                       attention_weights=attn, learned_positions=False, tagged_norms=False,
                       tie_embeddings=bool(cfg.get("tie_word_embeddings", True)), bias=False)
    name = p.parent.name if p.name == "config.json" and p.parent.name else p.stem
    return ModelSpec.from_shape(name, shape, head_dims=(d_qk, d_v), default_seq=seq,
                                seq_source=f"{seq_key} of {p}" if seq_key else
                                f"assumed: {p} names none of {', '.join(SEQ_KEYS)}")


def resolve_model(model: str | ModelSpec) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    from mixprec.models.config import MODEL_PRESETS
    key = str(model).strip().lower()
    if key in MODEL_PRESETS or key == "moe-67b":
        return _preset(key)
    if str(model).endswith(".json") or Path(model).is_dir():
        return model_from_hf_config(model)
    valid = [*MODEL_PRESETS, "moe-67b"]
    raise ConfigError(f"unknown model '{model}'{closest(key, valid)}; give a preset ({', '.join(valid)}), "
                      "a Hugging Face config.json path, or --params N --active-params N")


_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str | float, what: str = "value") -> float:
    """``"14.8T"`` -> 1.48e13 (suffixes K, M, B/G, T; plain numbers and ``1e9`` forms too)."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*", str(text), flags=re.I)
    if not m:
        raise ConfigError(f"{what} '{text}' is not a number (write e.g. 14.8T, 4M, 6.7e10)")
    return float(m.group(1)) * _SUFFIX[m.group(2).lower()]


@dataclass(frozen=True)
class Estimate:
    """One precision mode of one cluster run (per-GPU figures are for one GPU)."""

    model: str
    precision: str
    gpu: str
    num_gpus: int
    total_params: float
    active_params: float
    tokens: float
    seq: int
    global_batch_tokens: float
    flops_per_token: float
    """``6 * active_params`` plus the attention term (when counted)."""
    total_flops: float
    peak_flops: float
    """Dense peak of one GPU for the mode's GEMMs, FLOP/s."""
    mfu: float
    step_s: float
    tokens_per_s: float
    days: float
    gpu_hours: float
    power_w: float | None
    """Assumed mean draw of one GPU (default: its TDP)."""
    pue: float
    energy_mwh: float | None
    cluster_mw: float | None
    """Facility power while training: gpus * power * PUE."""
    usd_per_gpu_hour: float
    cost_usd: float
    memory: MemoryEstimate
    gpu_memory_gb: float | None
    parallelism: str
    dp: int
    tp: int
    pp: int
    micro_batch: int

    @property
    def fits(self) -> bool | None:
        """Whether the estimated per-GPU peak fits in the GPU's memory (None: unknown device)."""
        return None if self.gpu_memory_gb is None else self.memory.peak <= self.gpu_memory_gb * GB


def estimate(model: str | ModelSpec, *, tokens: float | str, gpu: str = "H800", num_gpus: int = 8,
             precision: str = "bf16-mixed", mfu: float = 0.4, global_batch_tokens: float | str | None = None,
             seq: int | None = None, micro_batch: int = 1, parallelism: str = "fsdp", tp: int = 1, pp: int = 1,
             checkpointing: bool = False, moments_dtype: str = "fp32", peak_tflops: float | None = None,
             power_w: float | None = None, pue: float = 1.2, usd_per_gpu_hour: float = 2.0,
             attention_flops: bool = True) -> Estimate:
    """Memory per GPU, step time, throughput, days, GPU-hours, energy and cost of training ``model``
    on ``tokens`` tokens with ``num_gpus`` GPUs of type ``gpu`` (``"cpu"``: this machine's measured
    GEMM peak) at a model-FLOPs utilisation ``mfu``. See the module docstring for the formulas."""
    from mixprec.precision import Precision
    spec = resolve_model(model)
    policy = Precision(precision)
    tokens = parse_count(tokens, "--tokens")
    if not tokens > 0:
        raise ConfigError(f"--tokens must be > 0 (the training token budget, e.g. 14.8T), got {tokens:g}")
    if not (isinstance(mfu, (int, float)) and 0 < mfu <= 1):
        raise ConfigError(f"--mfu must be in (0, 1] (a fraction: 0.4 means 40 %), got {mfu}")
    if parallelism not in PARALLELISMS:
        raise ConfigError(f"unknown parallelism '{parallelism}'{closest(parallelism, PARALLELISMS)}; "
                          f"valid: {', '.join(PARALLELISMS)}")
    if num_gpus < 1 or tp < 1 or pp < 1 or micro_batch < 1 or num_gpus % (tp * pp):
        raise ConfigError(f"--gpus ({num_gpus}) must be a positive multiple of --tp x --pp ({tp} x {pp}), "
                          "and --batch-size >= 1")
    if pue < 1 or usd_per_gpu_hour < 0 or (power_w is not None and power_w <= 0):
        raise ConfigError("--pue must be >= 1, --usd-per-gpu-hour >= 0 and --power-w > 0")
    seq = seq or spec.default_seq
    dp = num_gpus // (tp * pp)
    # default: 4Mi tokens, or one micro-batch per data-parallel rank if that is more
    batch = (max(4 * 2**20, seq * dp * micro_batch) if global_batch_tokens is None
             else parse_count(global_batch_tokens, "--global-batch"))
    if batch < seq * dp * micro_batch:
        raise ConfigError(f"--global-batch {batch:g} tokens is less than one micro-batch per data-parallel "
                          f"rank ({dp} x {micro_batch} x {seq} tokens)")

    kind = peak_kind(policy)
    if gpu.strip().lower() == "cpu":
        spec_gpu, gpu_name = None, "cpu"
        if peak_tflops is None:
            from mixprec.policy.peak import format_peak_flops, low_peak_reason, no_peak_reason
            peak = format_peak_flops(policy.layers.peak_format, "cpu")  # as fit()'s MFU; cached on disk
            if peak is None:
                why = (no_peak_reason(policy.layers.peak_format, "cpu")
                       or f"the one measured now is not trusted ({low_peak_reason(policy.layers.peak_format, 'cpu')})")
                raise ConfigError(f"no {policy.layers.peak_format.upper()} peak to measure: {why}; give --peak-tflops")
        else:
            peak = peak_tflops * 1e12
    else:
        spec_gpu = get_gpu(gpu)
        gpu_name = spec_gpu.name
        peak = peak_tflops * 1e12 if peak_tflops is not None else spec_gpu.peak_flops(kind)
    if not peak > 0:
        raise ConfigError(f"--peak-tflops must be > 0, got {peak_tflops}")
    power = power_w if power_w is not None else (spec_gpu.tdp_w if spec_gpu else None)

    fpt = 6.0 * spec.active_params + (spec.attention_coef * seq if attention_flops else 0.0)
    cluster = num_gpus * peak * mfu                                  # model FLOP/s of the whole run
    seconds = tokens * fpt / cluster
    step_s = batch * fpt / cluster
    gpu_hours = num_gpus * seconds / 3600
    shape = spec.shape
    if shape is not None and shape.learned_positions and seq > shape.max_seq_len:
        shape = replace(shape, max_seq_len=seq)               # as `mixprec train` builds the model
        spec = replace(spec, shape=shape, total_params=shape.num_parameters())
    mem = estimate_memory(shape, policy.name, batch=micro_batch, seq=seq, moments_dtype=moments_dtype,
                          checkpointing=checkpointing, shards=dp if parallelism == "fsdp" else 1, tp=tp,
                          pp=pp, num_parameters=None if shape is not None else int(spec.total_params))
    return Estimate(
        model=spec.name, precision=policy.name, gpu=gpu_name, num_gpus=num_gpus, total_params=spec.total_params,
        active_params=spec.active_params, tokens=tokens, seq=seq, global_batch_tokens=batch,
        flops_per_token=fpt, total_flops=tokens * fpt, peak_flops=peak, mfu=float(mfu), step_s=step_s,
        tokens_per_s=batch / step_s, days=seconds / 86400, gpu_hours=gpu_hours, power_w=power, pue=pue,
        energy_mwh=gpu_hours * power * pue / 1e6 if power else None,
        cluster_mw=num_gpus * power * pue / 1e6 if power else None, usd_per_gpu_hour=usd_per_gpu_hour,
        cost_usd=gpu_hours * usd_per_gpu_hour, memory=mem,
        gpu_memory_gb=spec_gpu.memory_gb if spec_gpu else None, parallelism=parallelism, dp=dp, tp=tp, pp=pp,
        micro_batch=micro_batch)


def format_count(x: float) -> str:
    """3 significant digits with an SI suffix: 1.48e13 -> '14.8T'."""
    for div, suf in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suf}"
    return f"{x:.3g}"


def format_estimates(rows: list[Estimate]) -> str:
    """A header of the shared assumptions, then one column per precision mode."""
    e = rows[0]
    mem_unit, mem_name = (GB, "GB") if e.memory.peak > 1e9 else (2**20, "MiB")
    power = f"{e.power_w:g} W per GPU ({'TDP' if e.gpu != 'cpu' else 'given'})" if e.power_w else "unknown (--power-w)"
    lines = [
        f"model: {e.model}: {format_count(e.total_params)} parameters, {format_count(e.active_params)} active per token; "
        f"{format_count(e.tokens)} tokens of {e.seq}",
        f"cluster: {e.num_gpus} x {e.gpu}"
        + (f" ({e.gpu_memory_gb:g} GB)" if e.gpu_memory_gb else "")
        + f"; {e.parallelism} dp={e.dp} tp={e.tp} pp={e.pp}; global batch {format_count(e.global_batch_tokens)} tokens, "
        f"micro-batch {e.micro_batch}",
        f"assumed: MFU {e.mfu:.1%}; power {power}; PUE {e.pue:g}; ${e.usd_per_gpu_hour:g} per GPU-hour",
        f"FLOPs per token: {format_count(e.flops_per_token)} (6 x {format_count(e.active_params)} active"
        + (f" + attention {format_count(e.flops_per_token - 6 * e.active_params)}" if e.flops_per_token > 6 * e.active_params
           else "") + f"); in all {e.total_flops:.3g}",
        "",
    ]
    table = [
        ("peak TFLOPS/GPU (dense)", lambda r: f"{r.peak_flops / 1e12:.4g}"),
        (f"memory/GPU {mem_name}", lambda r: f"{r.memory.peak / mem_unit:.2f}"
         + ("" if r.memory.activations or r.memory.peak < 1 else "*")),
        ("fits in GPU memory", lambda r: {None: "n/a", True: "yes", False: "no"}[r.fits]),
        ("step time s", lambda r: f"{r.step_s:.4g}"),
        ("tokens/s (cluster)", lambda r: format_count(r.tokens_per_s)),
        ("days", lambda r: f"{r.days:.4g}"),
        ("GPU-hours", lambda r: format_count(r.gpu_hours)),
        ("cluster power MW", lambda r: f"{r.cluster_mw:.3g}" if r.cluster_mw else "n/a"),
        ("energy MWh", lambda r: f"{r.energy_mwh:.4g}" if r.energy_mwh else "n/a"),
        ("cost $", lambda r: format_count(r.cost_usd)),
    ]
    width = max(14, *(len(r.precision) + 2 for r in rows))
    lines.append(f"{'':<24}" + "".join(f"{r.precision:>{width}}" for r in rows))
    for label, fmt in table:
        lines.append(f"{label:<24}" + "".join(f"{fmt(r):>{width}}" for r in rows))
    if any(not r.memory.activations for r in rows):
        lines.append("* states only (parameters, gradients, masters, Adam moments): no layer shapes to "
                     "count activations; give a preset or a config.json")
    return "\n".join(lines)
