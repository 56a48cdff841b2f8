"""Mixture-of-experts MLP with an FP32 router and experts in their own dtype.

The source article on hardware cost (docs/sources.md) declares ``nn.Linear(...,
dtype=torch.float16)`` experts next to an FP32 gating layer and stops there. Done properly, three
things matter:

* **The router stays FP32, always.** Routing is a discrete decision (top-k of a softmax): a score
  rounded in BF16 flips which expert a token goes to, and the load-balancing loss is a product of
  small probabilities. :class:`MoEGate` owns its weight directly, sets ``keep_in_fp32 = True`` (so
  the precision policy never casts it) and computes its logits with autocast *disabled*, so an
  enclosing ``mixprec.autocast("bf16-mixed")`` cannot lower it either.
* **Experts run in ``expert_dtype``.** With an explicit ``expert_dtype`` the expert weights are
  created in it and each expert runs with autocast disabled on inputs cast to its weights' dtype,
  so a BF16 autocast region does not silently turn FP16 experts into BF16 ones. With
  ``expert_dtype=None`` experts are ordinary FP32 modules that follow the policy (autocast and
  :func:`mixprec.precision.cast_module`) like every other Linear. The layer's default keeps the
  article's FP16; :class:`mixprec.models.Transformer` defaults to ``None`` because FP16 math is
  emulated (and ~100x slower than FP32) on CPUs without AVX512-FP16, and FP16 experts without
  loss scaling risk overflow; on GPUs the policy then picks BF16 or FP16 compute. Low-precision
  expert weights need FP32 master weights in the optimizer (``mixprec.optim``), as any 16-bit
  parameter does.
* **Dispatch is vectorised.** Token-to-expert assignments are sorted by expert once; each expert
  processes its contiguous slice with one batched matmul pair, and results are scattered back with
  one ``index_add_``. The loop is over experts (a handful), never over tokens. It costs one host
  sync per layer (``counts.tolist()`` to split the slices).

Routing: ``p = softmax(x W_g)`` over E experts (FP32); each token keeps its ``top_k`` experts with
weights ``p_i / sum_{j in top-k} p_j`` (normalised to sum to one); the output is the weighted sum of
those experts' outputs, accumulated in FP32 and returned in the input dtype.

Load-balancing loss (Switch Transformer, eq. 4, generalised to top-k as in GShard):
``aux = coef * E * sum_e f_e * P_e`` where ``f_e`` is the fraction of the ``N * top_k`` token
assignments that went to expert e (not differentiable) and ``P_e`` the mean router probability of
expert e over the N tokens (differentiable). It equals ``coef`` for a perfectly uniform router and
grows as routing concentrates. Its last value is in :attr:`MoELayer.aux_loss`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.errors import ConfigError

__all__ = ["MoEGate", "Expert", "MoELayer"]


class MoEGate(nn.Module):
    """Router: ``(N, C) -> (N, E)`` logits, always computed and stored in ``dtype`` (FP32 by default)."""

    keep_in_fp32 = True
    """Read by :meth:`mixprec.Policy.keeps_fp32`: the router weight stays FP32 under every policy."""

    def __init__(self, d_model: int, num_experts: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, d_model, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N, C) -> (N, E)
        with torch.autocast(device_type=x.device.type, enabled=False):
            return F.linear(x.to(self.weight.dtype), self.weight)


class Expert(nn.Module):
    """One expert: ``fc -> GELU -> proj`` (``(n, C) -> (n, C)``), weights in ``dtype``."""

    def __init__(self, d_model: int, d_hidden: int, dtype: torch.dtype | None, bias: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, d_hidden, bias=bias, dtype=dtype)
        self.proj = nn.Linear(d_hidden, d_model, bias=bias, dtype=dtype)
        self.proj.is_residual_projection = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class MoELayer(nn.Module):
    """Top-k routed mixture of ``num_experts`` MLP experts (see the module docstring).

    ``x: (..., C) -> (..., C)`` in ``x``'s dtype. After each forward, :attr:`aux_loss` holds the
    load-balancing loss (a scalar FP32 tensor attached to the graph) and :attr:`last_counts` the
    number of assignments each expert received (an int64 tensor, for monitoring).
    """

    def __init__(self, d_model: int, num_experts: int = 4, top_k: int = 2, d_hidden: int | None = None,
                 expert_dtype: torch.dtype | None = torch.float16, gate_dtype: torch.dtype = torch.float32,
                 *, aux_loss_coef: float = 0.01, bias: bool = True) -> None:
        super().__init__()
        if num_experts < 1:
            raise ConfigError(f"num_experts must be at least 1, got {num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ConfigError(f"top_k must be between 1 and num_experts ({num_experts}), got {top_k}")
        if gate_dtype != torch.float32 and gate_dtype != torch.float64:
            raise ConfigError(f"gate_dtype {gate_dtype} would round routing scores; use torch.float32")
        self.d_model, self.num_experts, self.top_k = d_model, num_experts, top_k
        self.d_hidden = d_hidden or 4 * d_model
        self.expert_dtype = expert_dtype
        self.aux_loss_coef = float(aux_loss_coef)
        self.gate = MoEGate(d_model, num_experts, dtype=gate_dtype)
        self.experts = nn.ModuleList(Expert(d_model, self.d_hidden, expert_dtype, bias) for _ in range(num_experts))
        self.aux_loss: torch.Tensor | None = None
        self.last_counts: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router decisions for flat tokens ``x: (N, C)``.

        Returns ``probs (N, E)`` (FP32 softmax), ``topk_idx (N, k)`` and ``topk_w (N, k)`` (FP32,
        rows sum to one).
        """
        logits = self.gate(x)  # (N, E), gate dtype
        probs = torch.softmax(logits.float(), dim=-1)  # (N, E) fp32
        topk_p, topk_idx = probs.topk(self.top_k, dim=-1)  # (N, k)
        topk_w = topk_p / topk_p.sum(dim=-1, keepdim=True)
        return probs, topk_idx, topk_w

    def _run_expert(self, expert: Expert, x: torch.Tensor) -> torch.Tensor:
        if self.expert_dtype is None:
            return expert(x)  # follows the ambient autocast / the policy's param dtype
        wdtype = expert.fc.weight.dtype  # the dtype the weights have now (cast_module may change it)
        with torch.autocast(device_type=x.device.type, enabled=False):
            return expert(x.to(wdtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, C = x.shape, x.shape[-1]
        flat = x.reshape(-1, C)  # (N, C)
        N, k, E = flat.shape[0], self.top_k, self.num_experts
        probs, topk_idx, topk_w = self.route(flat)

        # Sort the N*k (token, expert) assignments by expert so each expert's tokens are contiguous.
        assign_expert = topk_idx.reshape(-1)  # (N*k,)
        order = torch.argsort(assign_expert, stable=True)  # (N*k,)
        token_of = torch.div(order, k, rounding_mode="floor")  # (N*k,) token index of each sorted slot
        weight_of = topk_w.reshape(-1)[order]  # (N*k,) fp32
        counts = torch.bincount(assign_expert, minlength=E)  # (E,)
        self.last_counts = counts.detach()

        out = torch.zeros(N, C, dtype=torch.float32, device=x.device)  # fp32 accumulator
        start = 0
        for e, n_e in enumerate(counts.tolist()):  # one host sync per layer; loop over experts only
            if n_e == 0:
                continue
            tok = token_of[start:start + n_e]  # (n_e,)
            y = self._run_expert(self.experts[e], flat.index_select(0, tok))  # (n_e, C)
            out.index_add_(0, tok, y.float() * weight_of[start:start + n_e, None])
            start += n_e

        # Switch/GShard load balancing: coef * E * sum_e f_e * P_e.
        frac = counts.to(torch.float32) / (N * k)  # (E,) f_e, no gradient
        mean_prob = probs.mean(dim=0)  # (E,) P_e, differentiable
        self.aux_loss = self.aux_loss_coef * E * torch.sum(frac * mean_prob)
        return out.to(x.dtype).reshape(shape)

    def extra_repr(self) -> str:
        dt = "policy" if self.expert_dtype is None else str(self.expert_dtype).removeprefix("torch.")
        return (f"d_model={self.d_model}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"d_hidden={self.d_hidden}, expert_dtype={dt}, aux_loss_coef={self.aux_loss_coef}")
