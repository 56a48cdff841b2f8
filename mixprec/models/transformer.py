"""A decoder-only Transformer language model built from mixprec's numerics-safe layers.

Pre-norm GPT-2 layout: token + learned position embeddings, ``num_layers`` blocks of
``x + attn(norm(x))`` and ``x + mlp(norm(x))`` (the MLP may be a mixture of experts), a final
norm and a (by default tied) output head.

Precision is not hard-coded here. The model *declares* what must stay FP32 and the precision
policy reads it: norms and the MoE router carry ``keep_in_fp32 = True``; with
``fp32_embeddings=True`` so do the embeddings and the output head. ``mixprec.autocast(policy)``
around the forward chooses the compute dtype of the matmuls; the attention softmax (mixprec.nn.
attention) and the loss are FP32 whatever that dtype is.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.precision.cast import mark_fp32_params
from torch.utils.checkpoint import checkpoint

from mixprec.errors import ConfigError
from mixprec.models.config import TransformerConfig, get_model_config
from mixprec.nn.attention import CausalSelfAttention
from mixprec.nn.moe import MoELayer
from mixprec.nn.norms import make_norm

__all__ = ["Transformer", "Block", "MLP"]


class MLP(nn.Module):
    """``fc -> GELU -> proj``: ``(B, T, C) -> (B, T, C)`` with hidden width ``mlp_ratio * C``."""

    def __init__(self, d_model: int, d_hidden: int, bias: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, d_hidden, bias=bias)
        self.proj = nn.Linear(d_hidden, d_model, bias=bias)
        self.proj.is_residual_projection = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One pre-norm block. ``forward(x) -> (x, aux)`` where ``aux`` is the MoE loss (0 when dense)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.ln1 = make_norm(cfg.norm, cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.num_heads, dropout=cfg.dropout, bias=cfg.bias,
                                        impl=cfg.attention_impl)
        self.ln2 = make_norm(cfg.norm, cfg.d_model, bias=cfg.bias)
        d_hidden = cfg.mlp_ratio * cfg.d_model
        if cfg.num_experts:
            self.mlp: nn.Module = MoELayer(cfg.d_model, cfg.num_experts, cfg.top_k, d_hidden,
                                           expert_dtype=cfg.moe_expert_dtype, aux_loss_coef=cfg.moe_aux_loss_coef,
                                           bias=cfg.bias)
        else:
            self.mlp = MLP(cfg.d_model, d_hidden, cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x: (B, T, C)
        x = x + self.attn(self.ln1(x))
        h = self.mlp(self.ln2(x))
        if self.dropout and self.training:
            h = F.dropout(h, p=self.dropout)
        x = x + h
        aux = self.mlp.aux_loss if isinstance(self.mlp, MoELayer) else x.new_zeros((), dtype=torch.float32)
        return x, aux


class Transformer(nn.Module):
    """Decoder-only language model (see the module docstring and :class:`TransformerConfig`).

    ``forward(idx, targets=None) -> (logits, loss)``: ``idx`` and ``targets`` are int64 ``(B, T)``;
    ``logits`` are FP32 ``(B, T, vocab_size)``; ``loss`` is None without targets, else the FP32
    cross-entropy plus the MoE load-balancing loss (whose value is kept in :attr:`aux_loss`).
    """

    def __init__(self, num_layers: int, d_model: int, num_heads: int, vocab_size: int = 256,
                 max_seq_len: int = 1024, amp_enabled: bool = True, *, mlp_ratio: int = 4, dropout: float = 0.0,
                 norm: str = "layernorm", bias: bool = True, num_experts: int = 0, top_k: int = 2,
                 moe_expert_dtype: torch.dtype | None = None, moe_aux_loss_coef: float = 0.01,
                 gradient_checkpointing: bool = False, tie_embeddings: bool = True,
                 fp32_embeddings: bool = False, attention_impl: str = "sdpa") -> None:
        super().__init__()
        cfg = TransformerConfig(
            num_layers=num_layers, d_model=d_model, num_heads=num_heads, vocab_size=vocab_size,
            max_seq_len=max_seq_len, amp_enabled=amp_enabled, mlp_ratio=mlp_ratio, dropout=dropout, norm=norm,
            bias=bias, num_experts=num_experts, top_k=top_k, moe_expert_dtype=moe_expert_dtype,
            moe_aux_loss_coef=moe_aux_loss_coef, gradient_checkpointing=gradient_checkpointing,
            tie_embeddings=tie_embeddings, fp32_embeddings=fp32_embeddings, attention_impl=attention_impl)
        self.config = cfg
        self.gradient_checkpointing = cfg.gradient_checkpointing
        self.loss_chunk = 0
        """Tokens per slice of a chunked loss (0: off). With targets, the head and the FP32
        cross-entropy then run a slice at a time and are recomputed in backward, so the
        ``(tokens, vocab)`` FP32 logits, their log-softmax and its gradient exist for one slice
        at a time, not for the whole batch; ``forward`` returns ``None`` for the logits. The loss
        equals the plain one within FP32 summation order; with 16-bit parameters the head's
        weight gradient is summed over the slices in the parameter dtype (one rounding per
        slice). docs/lean.md."""
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = make_norm(cfg.norm, cfg.d_model, bias=cfg.bias)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.wte.weight
        if cfg.fp32_embeddings:
            for m in (self.wte, self.wpe, self.head):
                m.keep_in_fp32 = True  # read by the rule book (mixprec.precision.rules)
        self.aux_loss: torch.Tensor | None = None
        self._init_weights()
        mark_fp32_params(self)  # so AdamW(fp16_params=True) leaves norms and the router in FP32

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: TransformerConfig) -> "Transformer":
        fields = {f: getattr(config, f) for f in config.__dataclass_fields__}
        return cls(**fields)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "Transformer":
        """A model from a named preset (``tiny``, ``small``, ``gpt-ref``) with ``overrides`` applied."""
        return cls.from_config(get_model_config(name, **overrides))

    def _init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02) for Linear/Embedding weights, zero biases, and residual
        projections (attention and MLP outputs) scaled by 1/sqrt(2 * num_layers) so the residual
        stream's variance does not grow with depth."""
        resid_std = 0.02 / math.sqrt(2 * self.config.num_layers)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                std = resid_std if getattr(m, "is_residual_projection", False) else 0.02
                nn.init.normal_(m.weight, mean=0.0, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)

    # --- forward ------------------------------------------------------------------------------

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = idx.shape
        if T > self.config.max_seq_len:
            raise ConfigError(f"sequence length {T} exceeds max_seq_len {self.config.max_seq_len}; "
                              "use shorter sequences or build the model with a larger max_seq_len")
        ctx = (contextlib.nullcontext() if self.config.amp_enabled
               else torch.autocast(device_type=idx.device.type, enabled=False))
        with ctx:
            pos = torch.arange(T, device=idx.device)
            x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
            if self.config.dropout and self.training:
                x = F.dropout(x, p=self.config.dropout)
            aux_total = x.new_zeros((), dtype=torch.float32)
            recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
            for block in self.blocks:
                if recompute:
                    x, aux = checkpoint(block, x, use_reentrant=False)
                else:
                    x, aux = block(x)
                aux_total = aux_total + aux
            h = self.ln_f(x)
            if targets is not None and self.loss_chunk:
                logits, loss = None, self._chunked_loss(h.reshape(B * T, -1), targets.reshape(B * T))
            else:
                logits = self.head(h).float()  # (B, T, V) fp32
        self.aux_loss = aux_total.detach() if self.config.num_experts else None
        if targets is None:
            return logits, None
        if logits is not None:
            loss = F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T), ignore_index=-100)
        if self.config.num_experts:
            loss = loss + aux_total
        return logits, loss

    def _chunked_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the non-ignored targets, ``loss_chunk`` tokens at a time, each
        slice's head and log-softmax recomputed in backward (``torch.utils.checkpoint``)."""
        if not isinstance(self.loss_chunk, int) or self.loss_chunk < 0:
            raise ConfigError(f"loss_chunk must be a number of tokens >= 0 (0: off), got {self.loss_chunk!r}")
        total = h.new_zeros((), dtype=torch.float32)
        for a in range(0, h.shape[0], self.loss_chunk):
            total = total + checkpoint(self._loss_sum, h[a:a + self.loss_chunk],
                                       targets[a:a + self.loss_chunk], use_reentrant=False)
        return total / (targets != -100).sum()

    def _loss_sum(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(h).float(), targets, ignore_index=-100, reduction="sum")

    # --- accounting ---------------------------------------------------------------------------

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Distinct parameters (a tied head counts once). ``exclude_embeddings`` drops the position
        embedding and the token embedding (the latter only when it is not also the head)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.wpe.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.wte.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs (forward + backward) per token at sequence length ``seq_len``.

        ``6 * N + 6 * L * d * T``: ``N`` counts the parameters used in matmuls per token (all but
        the embedding look-ups; the head counts even when tied; for MoE only ``top_k`` of the
        experts), each costing 2 FLOPs forward and 4 backward. The attention term is ``q @ k^T``
        and ``probs @ v`` (``2 * 2 * T * d`` per layer per token forward, x3 with backward), halved
        because a causal mask leaves half the score matrix unused: ``12 L d T / 2``. This matches
        ``flops_per_step / (B * T)`` of the shared reference model (bench/gpt_ref.py).
        """
        cfg = self.config
        T = cfg.max_seq_len if seq_len is None else seq_len
        n = self.num_parameters(exclude_embeddings=True)
        if cfg.num_experts:
            per_expert = sum(p.numel() for p in self.blocks[0].mlp.experts[0].parameters())
            n -= cfg.num_layers * per_expert * (cfg.num_experts - cfg.top_k)
        return 6.0 * n + 6.0 * cfg.num_layers * cfg.d_model * T

    # --- sampling -----------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` ``(B, T)`` and return ``(B, T + new)``.

        ``temperature`` 0 means greedy; ``top_k`` keeps only the k most likely tokens. No KV cache:
        each step re-reads the last ``max_seq_len`` tokens. Call ``model.eval()`` first to disable
        dropout.
        """
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.max_seq_len:]
            logits, _ = self(context)
            logits = logits[:, -1, :]  # (B, V) fp32
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx

    # --- training -----------------------------------------------------------------------------

    def fit(self, train_loader, **kwargs):
        """Train with :func:`mixprec.fit` (see there for the options).

        The seed's ``model.fit(...)`` API. The model room sits below the training loop, so this
        goes through the public top-level ``mixprec.fit`` (the package above every room), not
        through an import of ``mixprec.train``."""
        import mixprec
        return mixprec.fit(self, train_loader, **kwargs)
