"""How a batch becomes a loss, decided once from what the model and the first batch *are*.

``fit()``, the planner, ``mixprec audit`` and the non-finite trace replay all call the one
:class:`Objective` that :func:`make_objective` builds, so they cannot disagree about the loss. The
first batch decides the path; every later batch must have the same shape (one line if not).

=====================================  ===========================================================
batch                                  loss
=====================================  ===========================================================
anything, with ``loss_fn``             ``loss_fn(outputs, targets)``: ``outputs = model(inputs)``,
                                       or ``model(**inputs)`` for dict inputs; a dict batch's
                                       targets are its ``"labels"`` (not passed to the model); an
                                       object batch is passed whole (``targets`` is the batch). A
                                       floating output tensor is first cast to the output dtype.
a dict (``{"input_ids", ...,           ``model(**batch).loss``: any Hugging Face model that
"attention_mask", "labels"}``)         computes its own loss from ``labels`` (causal LM, masked
                                       LM, sequence classification, seq2seq, vision); also any
                                       model whose ``forward(**batch)`` returns a loss
``(inputs_dict, labels)``              ``model(**inputs_dict, labels=labels).loss``
``(tokens, next_tokens)`` for a        ``model(input_ids=tokens)`` and the FP32 next-token
causal LM (Hugging Face style)         cross-entropy of ``out.logits`` against the targets, which
                                       mixprec's loader has already shifted (so they are not
                                       passed as ``labels``, which the model would shift again)
``(inputs, targets)``, other models    ``model(inputs, targets)`` returning its own loss (a scalar,
                                       ``(logits, loss)``, ``{"loss": ...}`` or ``.loss``:
                                       mixprec's ``Transformer``); a Hugging Face model:
                                       ``model(inputs, labels=targets).loss`` (images and
                                       labels, token ids and class labels)
an object with ``.to()``               ``model(batch)`` returning its own loss
=====================================  ===========================================================

Token ids with targets of the same shape, for a Hugging Face model that is *not* a causal LM
(BERT, T5), are refused without ``loss_fn``: they are what mixprec's token loaders yield
(next-token windows), and handing them to an encoder as ``labels`` would train it to read the
answer.

**Tokens.** :meth:`Objective.tokens` counts the real tokens of a batch for tokens/s and MFU: the
``attention_mask``'s ones when there is a mask (padding is not work), else every input id; a
device tensor, so counting adds no host sync. Batches without token ids (images) have no token
count (``None``; tokens/s and MFU are then not logged).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.precision import Precision
from mixprec.errors import ConfigError

__all__ = ["Objective", "make_objective", "extract_loss", "is_causal_lm", "describe_batch",
           "add_tokens", "count_samples", "apply_loss_chunk"]

LossFn = Callable[[Any, Any], torch.Tensor]
_MISSING = object()
_SHAPES = ("(inputs, targets) with tensor or dict inputs, a dict with 'labels' (Hugging Face "
           "style), or an object with .to()")


# --- what a batch is -------------------------------------------------------------------------------

def _shape(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).removeprefix('torch.')} tensor of shape {tuple(x.shape)}"
    if isinstance(x, Mapping):
        return f"dict with keys {sorted(map(str, x))}"
    return type(x).__name__


def describe_batch(batch: Any) -> str:
    """A short description of a batch for error messages: ``"a tuple of 3 (int64 tensor ...)"``."""
    if isinstance(batch, (tuple, list)):
        parts = ", ".join(_shape(x) for x in batch[:3]) + (", ..." if len(batch) > 3 else "")
        return f"a {type(batch).__name__} of {len(batch)} ({parts})"
    shape = _shape(batch)
    return ("an " if shape[0] in "aeiou" else "a ") + shape


def _is_pair(batch: Any) -> bool:
    return isinstance(batch, (tuple, list)) and len(batch) == 2


def _has_to(batch: Any) -> bool:
    return not isinstance(batch, (torch.Tensor, Mapping, tuple, list)) and callable(
        getattr(batch, "to", None))


def _signature(batch: Any) -> tuple:
    """What must stay the same from batch to batch (cheap: types and keys, no tensor reads)."""
    if isinstance(batch, Mapping):
        return ("dict", frozenset(batch))
    if _is_pair(batch):
        x = batch[0]
        return ("pair", ("dict", frozenset(x)) if isinstance(x, Mapping) else type(x))
    return (type(batch),)


def _count_tokens(x: Any) -> torch.Tensor | int | None:
    """Non-padding tokens of a dict / object with ``attention_mask`` / ``input_ids``, or of an
    integer tensor of token ids; None when the inputs are not tokens."""
    get = x.get if isinstance(x, Mapping) else (lambda k: getattr(x, k, None))
    mask = get("attention_mask")
    if isinstance(mask, torch.Tensor):
        return mask.sum()                       # stays on the device: no host sync
    ids = get("input_ids") if not isinstance(x, torch.Tensor) else x
    if isinstance(ids, torch.Tensor) and not ids.is_floating_point():
        return ids.numel()
    return None


# --- what a model is ----------------------------------------------------------------------------

def extract_loss(out: Any) -> torch.Tensor:
    """Find the loss in a model's output: a scalar tensor, ``(logits, loss)``, ``{"loss": ...}``
    or an object with ``.loss``; raises :class:`ConfigError` (caught by the objective, which says
    what to pass) when there is none."""
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[-1], torch.Tensor) and out[-1].dim() == 0:
        return out[-1]
    if isinstance(out, Mapping) and out.get("loss") is not None:
        return out["loss"]
    if not isinstance(out, Mapping) and getattr(out, "loss", None) is not None:
        return out.loss
    raise ConfigError(f"the model returned {_shape(out)}, not a loss (a scalar tensor, "
                      "(logits, loss), {'loss': ...} or .loss)")


def _forward_params(model: nn.Module) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return {}


def _takes(model: nn.Module, name: str) -> bool:
    params = _forward_params(model)
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _is_hf(model: nn.Module) -> bool:
    return hasattr(model, "config") and type(model).__module__.startswith("transformers.")


def _hf_head_kind(model: nn.Module) -> str | None:
    """For a Hugging Face ``PreTrainedModel``: ``"causal"`` when its class is a causal-LM head
    (per transformers' own auto mapping), else a short description of what it is."""
    if not _is_hf(model):
        return None
    if getattr(model.config, "is_encoder_decoder", False):
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
    kind = _hf_head_kind(model)
    if kind is not None:
        return kind == "causal"
    params = _forward_params(model)
    return "input_ids" in params and "labels" in params


def _loss_fn_hint(hf: bool, targets: Any) -> str:
    """``loss_fn=...`` shaped for what the targets look like (class ids, token ids, values)."""
    logits = "out.logits" if hf else "out"
    if isinstance(targets, torch.Tensor) and targets.is_floating_point():
        fn = f"F.mse_loss({logits}.float(), targets)"
    elif isinstance(targets, torch.Tensor) and targets.dim() >= 2:      # (B, T) token ids
        fn = f"F.cross_entropy({logits}.float().flatten(0, 1), targets.flatten())"
    else:                                                              # (B,) class ids
        fn = f"F.cross_entropy({logits}.float(), targets)"
    return f"loss_fn=lambda out, targets: {fn}"


# --- the objective ------------------------------------------------------------------------------

class Objective:
    """``objective(model, batch) -> loss`` (call it inside the precision's autocast; the caller
    casts the loss to FP32). The path is decided from the first batch (module docstring) and kept;
    ``describe`` names it, :meth:`tokens` counts a batch's real tokens.

    ``objective(model, inputs, targets)`` (the form before dict batches) still works."""

    def __init__(self, model: nn.Module, precision: Precision, loss_fn: LossFn | None = None) -> None:
        self.model_name = type(model).__name__
        self.precision = precision
        self.loss_fn = loss_fn
        self._kind = _hf_head_kind(model)
        self._causal = is_causal_lm(model)
        self._cache_off = {"use_cache": False} if "use_cache" in _forward_params(model) else {}
        self._loss: Callable[[nn.Module, Any], torch.Tensor] | None = None
        self._first: tuple | None = None
        self._first_text = ""
        self.describe = "(not decided: no batch seen yet)"

    def __call__(self, model: nn.Module, batch: Any, targets: Any = _MISSING) -> torch.Tensor:
        if targets is not _MISSING:
            batch = (batch, targets)
        if self._loss is None:
            self._decide(model, batch)
        elif _signature(batch) != self._first:
            raise ConfigError(f"a batch is {describe_batch(batch)} but the first was "
                              f"{self._first_text}; every batch must have the same shape")
        try:
            return self._loss(model, batch)
        except ConfigError as e:   # extract_loss found no loss: say what to pass instead
            raise ConfigError(f"{self.describe} failed: {e}; {self._fix(batch)}") from None

    def tokens(self, batch: Any) -> torch.Tensor | int | None:
        """Real (non-padding) tokens in ``batch`` (a device tensor when counted from a mask), or
        None when its inputs are not token ids."""
        if isinstance(batch, Mapping) or _has_to(batch):
            return _count_tokens(batch)
        if _is_pair(batch):
            return _count_tokens(batch[0])
        return None

    def _fix(self, batch: Any) -> str:
        targets = batch[1] if _is_pair(batch) else (batch.get("labels") if isinstance(batch, Mapping) else None)
        return "pass " + _loss_fn_hint(self._kind is not None, targets) + " to fit()"

    def _refuse(self, batch: Any, why: str, instead: str = "") -> None:
        raise ConfigError(f"{self.model_name} got {describe_batch(batch)}: {why}; "
                          f"{instead}{self._fix(batch)}")

    def _decide(self, model: nn.Module, batch: Any) -> None:
        if isinstance(batch, Mapping):
            loss, self.describe = self._dict_objective(batch)
        elif _is_pair(batch):
            loss, self.describe = self._pair_objective(model, batch)
        elif _has_to(batch):
            loss, self.describe = self._object_objective()
        else:
            raise ConfigError(f"fit() cannot train on {describe_batch(batch)}; yield {_SHAPES} "
                              "from the data loader (a DataLoader collates (x, y) samples into "
                              "[inputs, targets])")
        self._loss = loss
        self._first, self._first_text = _signature(batch), describe_batch(batch)

    def _dict_objective(self, batch: Mapping) -> tuple[Callable, str]:
        loss_fn, convert, extra = self.loss_fn, self.precision.convert_output, self._cache_off
        keys = sorted(map(str, batch))
        if loss_fn is not None:
            if "labels" not in batch:
                raise ConfigError(f"loss_fn(outputs, targets) needs targets, but the dict batch "
                                  f"(keys {keys}) has no 'labels'; add them to the batch, or "
                                  "yield (inputs, targets)")

            def with_loss_fn(m, b):
                inputs = {**extra, **{k: v for k, v in b.items() if k != "labels"}}
                return loss_fn(convert(m(**inputs)), b["labels"])
            return with_loss_fn, "loss_fn(model(**batch without 'labels'), batch['labels'])"
        if self._kind is not None and "labels" not in batch:
            raise ConfigError(f"{self.model_name} got a dict batch with keys {keys} and no "
                              "'labels', so it computes no loss; add 'labels' to each batch (as "
                              "a transformers DataCollator does), or pass loss_fn=... to fit()")
        return (lambda m, b: extract_loss(m(**{**extra, **b}))), "model(**batch).loss"

    def _pair_objective(self, model: nn.Module, batch: Any) -> tuple[Callable, str]:
        loss_fn, convert, extra = self.loss_fn, self.precision.convert_output, self._cache_off
        inputs = batch[0]
        if loss_fn is not None:
            if isinstance(inputs, Mapping):
                return ((lambda m, b: loss_fn(convert(m(**{**extra, **b[0]})), b[1])),
                        "loss_fn(model(**inputs), targets)")
            return (lambda m, b: loss_fn(convert(m(b[0])), b[1])), "loss_fn(model(inputs), targets)"
        if isinstance(inputs, Mapping):
            if not _takes(model, "labels"):
                self._refuse(batch, "its forward takes no labels, so (inputs_dict, labels) gives "
                                    "it no loss")
            return ((lambda m, b: extract_loss(m(**{**extra, **b[0]}, labels=b[1]))),
                    "model(**inputs, labels=targets).loss")
        if not isinstance(inputs, torch.Tensor):
            self._refuse(batch, "inputs must be a tensor or a dict of tensors")
        if self._causal:
            if inputs.is_floating_point():
                self._refuse(batch, "a causal language model takes integer token ids")

            def next_token(m, b):
                out = m(input_ids=b[0], **extra)
                logits = out.logits if hasattr(out, "logits") else out["logits"]   # (B, T, V)
                # FP32 loss from the (maybe 16-bit) logits; targets are already the next tokens.
                return F.cross_entropy(logits.float().flatten(0, 1), b[1].flatten())
            return next_token, "next-token cross-entropy of model(input_ids=inputs).logits (FP32)"
        if self._kind is not None:                 # a Hugging Face model that is no causal LM
            targets = batch[1]
            if not inputs.is_floating_point() and getattr(targets, "shape", None) == inputs.shape:
                self._refuse(batch, f"it is {self._kind}, and token ids with targets of the same "
                                    "shape are next-token windows (what mixprec's token loaders "
                                    "yield), which as labels it would learn to copy",
                             "yield dicts {'input_ids', 'attention_mask', 'labels'} (it computes "
                             "its own loss from labels), or ")
            return (lambda m, b: extract_loss(m(b[0], labels=b[1]))), "model(inputs, labels=targets).loss"
        try:
            inspect.signature(model.forward).bind(object(), object())
        except TypeError:
            params = ", ".join(_forward_params(model))
            self._refuse(batch, f"its forward({params}) takes no targets, so it cannot return a loss")
        except ValueError:  # no signature (a C extension): trust the call
            pass
        return (lambda m, b: extract_loss(m(b[0], b[1]))), "model(inputs, targets) returning its own loss"

    def _object_objective(self) -> tuple[Callable, str]:
        loss_fn, convert = self.loss_fn, self.precision.convert_output
        if loss_fn is not None:
            return (lambda m, b: loss_fn(convert(m(b)), b)), "loss_fn(model(batch), batch)"
        return (lambda m, b: extract_loss(m(b))), "model(batch) returning its own loss"


def add_tokens(total: torch.Tensor | int | None, more: torch.Tensor | int | None
               ) -> torch.Tensor | int | None:
    """Token counts add up (on the device when counted from a mask); None stays None."""
    return None if total is None or more is None else total + more


def count_samples(batch: Any) -> int | None:
    """Examples in a batch: the leading size of its first tensor (the inputs of a pair, the first
    value of a dict); None when there is no tensor to count (shapes only, no host sync)."""
    x = batch[0] if _is_pair(batch) else batch
    if isinstance(x, Mapping):
        x = next((v for v in x.values() if isinstance(v, torch.Tensor)), None)
    elif not isinstance(x, torch.Tensor):
        x = getattr(x, "input_ids", None)
    return int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() > 0 else None


def make_objective(model: nn.Module, precision: Precision, loss_fn: LossFn | None = None) -> Objective:
    """The :class:`Objective` for ``model`` (module docstring); decided at its first batch."""
    return Objective(model, precision, loss_fn)


def apply_loss_chunk(model: nn.Module, tokens: int, *, loss_fn: object = None) -> None:
    """Set a run's chunked loss (``FitConfig.loss_chunk``: tokens per slice, 0: off) on ``model``.

    A model that computes its loss in slices declares an integer ``loss_chunk`` attribute
    (mixprec's :class:`~mixprec.models.Transformer` does); a setting that would not take effect
    is refused in one line: a model without one (a Hugging Face model, a module of yours), a
    ``loss_fn`` (the loss is then the caller's, over whole logits), and a model whose own
    ``loss_chunk`` disagrees with the run's (config.toml records the run's).
    """
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise ConfigError(f"loss_chunk must be a number of tokens >= 0 (0: off), got {tokens!r}")
    own = getattr(model, "loss_chunk", None)
    if not isinstance(own, int) or isinstance(own, bool):
        if tokens:
            raise ConfigError(f"loss_chunk={tokens} runs the output head and the loss together in "
                              "slices, which only mixprec's Transformer can (model=tiny, small, "
                              f"gpt-ref); a {type(model).__name__} returns its whole logits: set "
                              "loss_chunk=0")
        return
    if tokens and loss_fn is not None:
        raise ConfigError(f"loss_chunk={tokens} slices the model's own loss, but with loss_fn= the "
                          "loss is computed by your function over whole logits: set loss_chunk=0 "
                          "or drop loss_fn")
    if own not in (0, tokens):
        raise ConfigError(f"the model's loss_chunk is {own} but the run's is {tokens}: set "
                          f"loss_chunk={own} in the run's config (it is what config.toml "
                          "records), or model.loss_chunk = 0")
    model.loss_chunk = tokens
