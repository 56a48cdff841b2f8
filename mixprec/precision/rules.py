"""The rule book: what kind of layer a module is, and what that means for its precision.

Every "is this a norm / a gate / the output head / kept in FP32" question in mixprec is answered
here and nowhere else; "may this layer run in FP8 / a micro format" is answered from these kinds by
:func:`mixprec.precision.eligibility.refusal`. Casting and master weights (through
:meth:`mixprec.Precision.resolve`'s per-layer table), FSDP2's FP32 islands, FP8 conversion, the
audit, the planner, the memory estimator and the monitor all ask these functions.

Kinds of layer:

* **norm** (:func:`is_norm`): one of PyTorch's norm types, a class named ``...Norm``, or a module
  shaped and behaving like one (a 1-D ``weight`` beside only vectors, and an ``eps`` /
  ``variance_epsilon`` attribute: Hugging Face's ``LlamaRMSNorm``, ``T5LayerNorm``, a user's own).
  Their statistics lose precision in BF16 and overflow in FP16, and their weights are tiny.
* **gate** (:func:`is_gate`): an MoE gate/router: named ``gate``, ``router``, ``gating`` or
  ``gate_network``, or a class named ``...Gate`` / ``...Router``. Near-tied routing scores flip
  experts in 16 bits (DeepSeek-V3 keeps the router in FP32).
* **head** (:func:`is_head`): the output projection: a Linear tied to an embedding, or named
  ``lm_head``, ``head`` or ``output``.
* **embedding**: an ``nn.Embedding``.
* **linear** (:func:`is_gemm_layer`): any other ``nn.Linear`` or Hugging Face ``Conv1D``: the
  layers that get a per-layer compute format.

Kept in FP32 (:func:`keep_fp32_reason`): a module carrying a truthy ``keep_in_fp32`` attribute,
a norm (unless the policy says ``keep_norms_fp32=False``), a gate, an instance of one of the
policy's ``keep_fp32_types``, or a module whose name matches one of its ``keep_fp32_names``.
"""
from __future__ import annotations

import fnmatch

from torch import nn

from mixprec.formats.fp8_linear import Fp8Conv1D, is_conv1d

__all__ = ["TORCH_NORM_TYPES", "GATE_NAMES", "HEAD_NAMES", "is_norm", "is_gate", "is_head",
           "is_embedding", "is_gemm_layer", "layer_kind", "keep_fp32_reason",
           "embedding_weights"]

TORCH_NORM_TYPES: tuple[type[nn.Module], ...] = tuple(
    t for t in (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
                nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LocalResponseNorm,
                getattr(nn, "RMSNorm", None)) if t is not None
)
GATE_NAMES: frozenset[str] = frozenset({"gate", "router", "gating", "gate_network"})
HEAD_NAMES: frozenset[str] = frozenset({"lm_head", "head", "output"})

_EPS_NAMES = ("eps", "variance_epsilon", "epsilon")


def _last(qualified_name: str) -> str:
    return qualified_name.rpartition(".")[2]


def is_norm(module: nn.Module) -> bool:
    """True for normalisation layers: torch's own, or any module shaped and behaving like one."""
    if isinstance(module, TORCH_NORM_TYPES):
        return True
    if type(module).__name__.endswith("Norm"):
        return True
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return False
    if not any(isinstance(getattr(module, n, None), float) for n in _EPS_NAMES):
        return False
    # A norm owns vectors only (weight, maybe bias); a 1-D weight beside a matrix is something else.
    return all(p.dim() == 1 for p in module.parameters(recurse=False))


def norm_statistics_fp32(module: nn.Module) -> bool:
    """Whether a norm computes its statistics in FP32 whatever its dtype: torch's norm types
    (autocast runs them in FP32) and modules declaring ``keep_in_fp32`` (mixprec's norms upcast)."""
    return isinstance(module, TORCH_NORM_TYPES) or bool(getattr(module, "keep_in_fp32", False))


def is_gate(qualified_name: str, module: nn.Module) -> bool:
    """True for an MoE gate/router, by its name or its class name."""
    return (_last(qualified_name).lower() in GATE_NAMES
            or type(module).__name__.endswith(("Gate", "Router")))


def embedding_weights(model: nn.Module) -> set[int]:
    """``id`` of every embedding weight of ``model`` (a Linear sharing one is a tied head)."""
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


def is_head(qualified_name: str, module: nn.Module, embeddings: set[int] = frozenset()) -> bool:
    """True for the output head: tied to an embedding (``embeddings``: :func:`embedding_weights`),
    or named ``lm_head`` / ``head`` / ``output``."""
    return id(getattr(module, "weight", None)) in embeddings or _last(qualified_name) in HEAD_NAMES


def is_embedding(module: nn.Module) -> bool:
    return isinstance(module, nn.Embedding)


def is_gemm_layer(module: nn.Module) -> bool:
    """A layer that gets a per-layer format: an ``nn.Linear`` or a Hugging Face ``Conv1D`` (GPT-2;
    FP8 formats only: other formats leave a Conv1D in the surrounding format)."""
    return isinstance(module, (nn.Linear, Fp8Conv1D)) or is_conv1d(module)


def layer_kind(qualified_name: str, module: nn.Module, embeddings: set[int] = frozenset()) -> str:
    """``norm``, ``gate``, ``head``, ``embedding``, ``linear`` or ``other``."""
    if is_norm(module):
        return "norm"
    if is_gate(qualified_name, module):
        return "gate"
    if is_embedding(module):
        return "embedding"
    if is_gemm_layer(module):
        return "head" if is_head(qualified_name, module, embeddings) else "linear"
    return "other"


def keep_fp32_reason(policy, qualified_name: str, module: nn.Module) -> str | None:
    """Why ``module``'s own parameters stay FP32 under ``policy`` (a :class:`mixprec.Policy`), or
    None: they follow the mode."""
    if getattr(module, "keep_in_fp32", False):
        return "keep_in_fp32"
    if policy.keep_norms_fp32 and is_norm(module):
        return "norm"
    if is_gate(qualified_name, module):
        return "MoE gate/router"
    if policy.keep_fp32_types and isinstance(module, policy.keep_fp32_types):
        return f"keep_fp32_types ({type(module).__name__})"
    for pattern in policy.keep_fp32_names:
        if fnmatch.fnmatchcase(qualified_name, pattern):
            return f"keep_fp32_names '{pattern}'"
    return None
