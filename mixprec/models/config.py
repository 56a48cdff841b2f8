"""Shape and options of a :class:`mixprec.models.Transformer`, and named presets."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from mixprec.errors import ConfigError, closest
from mixprec.nn.attention import ATTENTION_IMPLS
from mixprec.nn.norms import NORM_LAYERS
from mixprec.policy.dtypes import parse_dtype

__all__ = ["TransformerConfig", "MODEL_PRESETS", "get_model_config"]


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """A decoder-only language model. Validated at construction; build variants with :meth:`replace`."""

    num_layers: int
    """Number of Transformer blocks."""
    d_model: int
    """Width of the residual stream."""
    num_heads: int
    """Attention heads; must divide ``d_model``."""
    vocab_size: int = 256
    """Token vocabulary (256 = raw bytes, what the built-in corpus uses)."""
    max_seq_len: int = 1024
    """Longest sequence the learned position embedding covers."""
    amp_enabled: bool = True
    """The source article's flag (docs/sources.md). True: the model runs under whatever autocast
    encloses it (``mixprec.autocast`` or ``torch.autocast``). False: the model opts out: its
    forward runs under ``torch.autocast(enabled=False)``, i.e. in the dtype of its parameters,
    whatever the caller set."""
    mlp_ratio: int = 4
    """Hidden width of the MLP (and of each MoE expert) as a multiple of ``d_model``."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches (training only)."""
    norm: str = "layernorm"
    """``"layernorm"`` or ``"rmsnorm"``; both compute statistics in FP32 (mixprec.nn.norms)."""
    bias: bool = True
    """Biases in Linear layers and LayerNorms (GPT-2 style)."""
    num_experts: int = 0
    """0: dense MLP blocks. >0: every block's MLP is a :class:`mixprec.nn.MoELayer` with this many experts."""
    top_k: int = 2
    """Experts per token when ``num_experts`` > 0."""
    moe_expert_dtype: torch.dtype | None = None
    """Storage/compute dtype of MoE experts. None (default): FP32 experts that follow the precision
    policy like any Linear (BF16/FP16 compute under autocast). Set e.g. ``torch.float16`` for the
    source article's fixed FP16 experts (slow on CPUs without native FP16; needs loss scaling)."""
    moe_aux_loss_coef: float = 0.01
    """Weight of the MoE load-balancing loss added to the language-model loss."""
    gradient_checkpointing: bool = False
    """Recompute each block's activations in backward (``torch.utils.checkpoint``, non-reentrant)."""
    tie_embeddings: bool = True
    """Share the token embedding matrix with the output head."""
    fp32_embeddings: bool = False
    """Mark the token/position embeddings and the output head ``keep_in_fp32`` so the policy keeps
    them FP32 even under ``bf16-true``/``16-true`` (they hold rare tokens' small updates)."""
    attention_impl: str = "sdpa"
    """``"sdpa"`` (fused, FP32 softmax inside) or ``"math"`` (explicit FP32 softmax, for testing)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "d_model", "num_heads", "vocab_size", "max_seq_len", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"TransformerConfig.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.num_heads:
            raise ConfigError(f"d_model {self.d_model} is not divisible by num_heads {self.num_heads}; "
                              "pick num_heads dividing d_model")
        if self.norm not in NORM_LAYERS:
            raise ConfigError(f"unknown norm '{self.norm}'{closest(self.norm, NORM_LAYERS)}; "
                              f"valid: {', '.join(NORM_LAYERS)}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ConfigError(f"unknown attention_impl '{self.attention_impl}'"
                              f"{closest(self.attention_impl, ATTENTION_IMPLS)}; valid: {', '.join(ATTENTION_IMPLS)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.num_experts < 0:
            raise ConfigError(f"num_experts must be 0 (dense) or positive, got {self.num_experts}")
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"top_k must be between 1 and num_experts ({self.num_experts}), got {self.top_k}")
        if self.moe_expert_dtype is not None:
            object.__setattr__(self, "moe_expert_dtype", parse_dtype(self.moe_expert_dtype))
        if self.moe_aux_loss_coef < 0:
            raise ConfigError(f"moe_aux_loss_coef must be >= 0, got {self.moe_aux_loss_coef}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def replace(self, **changes) -> "TransformerConfig":
        """A validated copy with some fields changed."""
        names = {f.name for f in dataclasses.fields(self)}
        for key in changes:
            if key not in names:
                raise ConfigError(f"unknown Transformer option '{key}'{closest(key, names)}")
        return dataclasses.replace(self, **changes)


MODEL_PRESETS: dict[str, TransformerConfig] = {
    # For tests: a few hundred thousand parameters; runs under emulated BF16/FP16 in well under a second.
    "tiny": TransformerConfig(num_layers=2, d_model=64, num_heads=4, vocab_size=256, max_seq_len=64),
    # The default `mixprec train` model on the built-in byte corpus (858,880 parameters). Measured on
    # the 2-core dev CPU (docs/benchmarks/model.md): one FP32 AdamW step at batch 16 x 128 costs
    # 0.43 s of CPU, so 300-600 steps take roughly 2-4 minutes on an idle machine.
    "small": TransformerConfig(num_layers=4, d_model=128, num_heads=4, vocab_size=256, max_seq_len=256),
    # Exactly /work/shared/bench/gpt_ref.py's shapes (untied head, like the reference).
    "gpt-ref": TransformerConfig(num_layers=6, d_model=512, num_heads=8, vocab_size=8192, max_seq_len=256,
                                 tie_embeddings=False),
    # GPT-2's shapes (Radford et al. 2019, table 2), vocabulary padded to 50304 (a multiple of 128,
    # as nanoGPT does) and tied embeddings: the sizes that fill a GPU in `bench train` and the
    # prepared GPU check (benchmarks/gpu/run_all.py). Too big for a CPU step in seconds.
    "gpt2-124m": TransformerConfig(num_layers=12, d_model=768, num_heads=12, vocab_size=50304),
    "gpt2-355m": TransformerConfig(num_layers=24, d_model=1024, num_heads=16, vocab_size=50304),
    "gpt2-774m": TransformerConfig(num_layers=36, d_model=1280, num_heads=20, vocab_size=50304),
}


def get_model_config(name: str | TransformerConfig, **overrides) -> TransformerConfig:
    """The preset ``name`` (``tiny``, ``small``, ``gpt-ref``, ``gpt2-124m``/``355m``/``774m``),
    with ``overrides`` applied."""
    if isinstance(name, TransformerConfig):
        cfg = name
    else:
        key = str(name).strip().lower()
        if key not in MODEL_PRESETS:
            raise ConfigError(f"unknown model preset '{name}'{closest(key, MODEL_PRESETS)}; "
                              f"valid: {', '.join(MODEL_PRESETS)}")
        cfg = MODEL_PRESETS[key]
    return cfg.replace(**overrides) if overrides else cfg
