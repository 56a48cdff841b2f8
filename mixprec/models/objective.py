"""How a batch becomes a loss: the model's own loss, a Hugging Face causal LM's logits, or the
user's ``loss_fn``. Decided once, when training starts, from what the model *is*; never guessed
from how many arguments ``forward`` happens to take.

Three kinds, in this order:

1. ``loss_fn`` given: ``loss_fn(model(inputs), targets)`` (a floating output tensor is first
   cast to the precision's output dtype).
2. A causal language model written like Hugging Face's (``forward`` takes ``input_ids`` and
   ``labels``; e.g. ``GPT2LMHeadModel``, ``LlamaForCausalLM``): ``model(input_ids=inputs)``, and
   the loss is the next-token cross-entropy of ``out.logits`` **in FP32** against mixprec's
   targets. mixprec's loader already shifts the targets by one token; passing them as ``labels=``
   would make the model shift them again (predicting two tokens ahead), so ``labels`` is not
   passed. The windows are packed, unpadded token streams: every token is real, so no
   ``attention_mask`` is passed (the model's default attends to every earlier token) and
   positions are ``0 .. T-1`` (the model's default ``position_ids``).
3. Otherwise the model returns its own loss when called as ``model(inputs, targets)``: a scalar,
   ``(logits, loss)``, ``{"loss": ...}`` or an object with ``.loss`` (mixprec's ``Transformer``).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.precision import Precision
from mixprec.errors import ConfigError

__all__ = ["Objective", "make_objective", "extract_loss", "is_causal_lm"]

Objective = Callable[[nn.Module, Any, torch.Tensor], torch.Tensor]
"""``objective(model, inputs, targets) -> loss`` (called inside the precision's autocast)."""

_LOSS_FN_HINT = ("pass loss_fn=lambda out, targets: ... to fit() (e.g. "
                 "F.cross_entropy(out.logits.float().flatten(0, 1), targets.flatten()))")


def extract_loss(out: Any) -> torch.Tensor:
    """Find the loss in a model's output: a scalar tensor, ``(logits, loss)``, ``{"loss": ...}``
    or an object with ``.loss``."""
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[-1], torch.Tensor) and out[-1].dim() == 0:
        return out[-1]
    if isinstance(out, dict) and out.get("loss") is not None:
        return out["loss"]
    if getattr(out, "loss", None) is not None:
        return out.loss
    raise ConfigError("the model's forward(inputs, targets) did not return a loss (a scalar "
                      "tensor, (logits, loss), {'loss': ...} or .loss); " + _LOSS_FN_HINT)


def _forward_params(model: nn.Module) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return {}


def _hf_head_kind(model: nn.Module) -> str | None:
    """For a Hugging Face ``PreTrainedModel``: ``"causal"`` when its class is a causal-LM head
    (per transformers' own auto mapping), else a short description of what it is."""
    config = getattr(model, "config", None)
    if config is None or not type(model).__module__.startswith("transformers."):
        return None
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder (seq2seq) model"
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        causal = {n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
                  for n in ((v,) if isinstance(v, str) else v)}
    except ImportError:  # pragma: no cover - very old transformers
        causal = set()
    name = type(model).__name__
    if name in causal or name.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal"
    return f"not a causal language model ({name})"


def is_causal_lm(model: nn.Module) -> bool:
    """A model written like a Hugging Face causal LM: ``forward(input_ids=..., labels=...)``."""
    params = _forward_params(model)
    kind = _hf_head_kind(model)
    if kind is not None:
        return kind == "causal"
    return "input_ids" in params and "labels" in params


def _causal_lm_objective(model: nn.Module) -> Objective:
    params = _forward_params(model)
    extra = {"use_cache": False} if "use_cache" in params else {}  # no KV cache while training

    def objective(m: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out = m(input_ids=inputs, **extra)
        logits = out.logits if hasattr(out, "logits") else out["logits"]   # (B, T, V)
        # FP32 loss from the (maybe 16-bit) logits; targets are already the next tokens.
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    return objective


def make_objective(model: nn.Module, precision: Precision,
                   loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None) -> Objective:
    """The objective for ``model`` (see the module docstring); a clear error when there is none."""
    if loss_fn is not None:
        def with_loss_fn(m: nn.Module, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
            return loss_fn(precision.convert_output(m(inputs)), targets)
        return with_loss_fn
    kind = _hf_head_kind(model)
    if kind is not None and kind != "causal":
        raise ConfigError(f"{type(model).__name__} is {kind}, so mixprec cannot compute its "
                          "next-token loss; " + _LOSS_FN_HINT)
    if is_causal_lm(model):
        return _causal_lm_objective(model)
    params = _forward_params(model)
    try:
        inspect.signature(model.forward).bind(object(), object())
    except TypeError:
        raise ConfigError(f"{type(model).__name__}.forward({', '.join(params)}) takes no targets, "
                          "so it cannot return a loss; " + _LOSS_FN_HINT) from None
    except ValueError:  # no signature (a C extension): trust the call
        pass

    def own_loss(m: nn.Module, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        return extract_loss(m(inputs, targets))
    return own_loss
