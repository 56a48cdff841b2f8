"""Training FLOPs per token of a model that does not count its own (a Hugging Face model, a
user's module): the numerator of ``fit()``'s MFU.

``6 * N + 6 * L * d * T``, the rule :meth:`mixprec.models.Transformer.flops_per_token` uses:
``N`` counts the parameters used in matmuls per token, i.e. all but the embedding look-ups (a
head tied to an embedding counts: its matmul is real), each 2 FLOPs forward and 4 backward. The
attention term (``q @ k^T`` and ``probs @ v``, halved for the causal mask) needs the number of
layers ``L`` and the width ``d`` from the model's ``config`` (``num_hidden_layers``/``n_layer``,
``hidden_size``/``n_embd``/``d_model``) and the sequence length ``T`` of the batches; without
them it is left out (and said). Counting the embeddings too, as before, overstated a tiny model's
MFU: in a 2-layer, 64-wide model with a 32k vocabulary they are most of the parameters.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from mixprec.precision.rules import embedding_weights, is_gemm_layer

__all__ = ["ModelFlops", "model_flops"]

_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_WIDTH_KEYS = ("hidden_size", "n_embd", "d_model")


@dataclass(frozen=True, kw_only=True)
class ModelFlops:
    """What a model's FLOPs per token are counted from."""

    matmul_params: int
    """Parameters used in matmuls per token (embedding look-ups left out; a tied head counts)."""
    layers: int | None = None
    """Transformer layers, from the model's config (None: no attention term)."""
    width: int | None = None
    """Model width ``d``, from the model's config."""

    def per_token(self, seq_len: float | None) -> float:
        """Training FLOPs per token at (mean) sequence length ``seq_len`` (None: unknown)."""
        attention = (6.0 * self.layers * self.width * seq_len
                     if self.layers and self.width and seq_len else 0.0)
        return 6.0 * self.matmul_params + attention

    def describe(self, seq_len: float | None) -> str:
        """What :meth:`per_token` counted, for a line about the MFU."""
        head = f"6 x {self.matmul_params:,} matmul parameters (embeddings left out)"
        if self.layers and self.width and seq_len:
            return head + f" + attention 6 x {self.layers} layers x {self.width} x T={seq_len:g}"
        return head + ", no attention term (" + ("sequence length unknown)" if self.layers and self.width
                                                  else "no layers/width in the model's config)")


def model_flops(model: nn.Module) -> ModelFlops:
    """:class:`ModelFlops` of ``model`` (parameters shared by several modules count once)."""
    embeddings = embedding_weights(model)
    gemm = {id(m.weight) for m in model.modules() if is_gemm_layer(m) and getattr(m, "weight", None) is not None}
    n = sum(p.numel() for p in model.parameters() if id(p) not in embeddings or id(p) in gemm)
    config = getattr(model, "config", None)

    def first(keys: tuple[str, ...]) -> int | None:
        for k in keys:
            v = getattr(config, k, None)
            if isinstance(v, int) and v > 0:
                return v
        return None
    return ModelFlops(matmul_params=n, layers=first(_LAYER_KEYS), width=first(_WIDTH_KEYS))
