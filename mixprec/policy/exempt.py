"""The one definition of "this module's parameters stay in FP32".

Casting, master weights, FSDP2's FP32 islands, the audit and FP8 conversion all ask
:func:`is_norm` and :meth:`mixprec.Policy.keeps_fp32`; nothing else in mixprec decides it.

A module stays FP32 when

* it is a normalisation layer: one of PyTorch's norm types, or a third-party norm recognised by
  its shape and behaviour (a 1-D ``weight`` and an ``eps`` / ``variance_epsilon`` attribute, e.g.
  Hugging Face's ``LlamaRMSNorm``, ``T5LayerNorm`` or a user's own RMSNorm), or a class whose name
  ends in ``Norm``;
* it carries a truthy ``keep_in_fp32`` attribute (mixprec's MoE gate, embeddings a user marks);
* its qualified name matches one of the policy's ``keep_fp32_names`` patterns;
* it is an instance of one of the policy's extra ``keep_fp32_types``.

Why norms: their statistics (a mean of squares over the hidden size) lose precision in BF16 and
overflow in FP16, and their weights are tiny (one vector per layer), so FP32 costs nothing.
"""
from __future__ import annotations

from torch import nn

__all__ = ["TORCH_NORM_TYPES", "is_norm"]

TORCH_NORM_TYPES: tuple[type[nn.Module], ...] = tuple(
    t for t in (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
                nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LocalResponseNorm,
                getattr(nn, "RMSNorm", None)) if t is not None
)

_EPS_NAMES = ("eps", "variance_epsilon", "epsilon")


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
