"""One optimizer step issued in parts (per module), bit-identical to the whole step.

The overlap engine (mixprec/optim/overlap.py) updates the parameters of the first layers while
the next forward already runs, so it needs ``optimizer.step()`` split by module. Building one
optimizer per module would copy state and change the checkpoint format; instead each part is a
*view*: the optimizer's ``param_groups`` are replaced, for the duration of one ``step()``, by
copies of its groups (same hyper-parameters) that list only that part's parameters. The state
(``optimizer.state``, keyed by parameter) is the optimizer's own, so ``state_dict()`` is the same
with and without parts, and a run saved with overlap resumes without it and vice versa.

This is exact only for an optimizer whose update of one parameter reads nothing but that
parameter, its gradient, its own state and its group's hyper-parameters (AdamW, Adam, SGD, ...:
:data:`SEPARABLE`). Global operations stay outside: gradient clipping happens before the step
(on all gradients), the step counter of torch's Adam family is per parameter, and the LR
scheduler steps once per real step. mixprec's BF16-moment AdamW with stochastic rounding is *not*
separable (the random stream is drawn per chunk of the whole group, so other chunks draw other
noise), nor are optimizers with a global statistic (LAMB-style trust ratios over all layers,
Shampoo, LBFGS); :func:`check_separable` refuses them with the fix.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from mixprec.errors import ConfigError

__all__ = ["SEPARABLE", "check_separable", "restricted_groups", "step_in_parts"]

SEPARABLE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta)
"""torch optimizers whose update is elementwise per parameter (state per parameter)."""


def _base(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    inner = getattr(optimizer, "inner", None)          # MasterWeights steps its inner optimizer
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def check_separable(optimizer: torch.optim.Optimizer) -> None:
    """Raise ConfigError unless ``optimizer``'s step can be split by parameter subsets exactly.

    A class may declare itself separable with a class attribute ``mixprec_separable = True``.
    """
    base = _base(optimizer)
    declared = getattr(type(base), "mixprec_separable", None)
    if callable(declared):
        declared = declared(base)
    ok = declared if declared is not None else isinstance(base, SEPARABLE)
    if not ok:
        why = getattr(type(base), "mixprec_not_separable_because", None)
        raise ConfigError(
            f"overlap_optimizer=true splits the optimizer step by module, which is exact only for "
            f"an elementwise optimizer (AdamW, Adam, SGD, ...); {type(base).__name__} "
            f"{why or 'is not known to be one'}. Set overlap_optimizer=false, or mark the class "
            "with mixprec_separable = True if its update of a parameter reads only that "
            "parameter, its gradient and its own state")


def restricted_groups(groups: list[dict[str, Any]], params: Sequence[Tensor]) -> list[dict[str, Any]]:
    """Copies of ``groups`` (same hyper-parameters) listing only ``params``, in group order.

    Empty groups are kept (empty), so a group's index means the same in the view."""
    keep = {id(p) for p in params}
    return [{**g, "params": [p for p in g["params"] if id(p) in keep]} for g in groups]


def step_in_parts(optimizer: torch.optim.Optimizer, parts: Sequence[Sequence[Tensor]],
                  around: Callable[[int], contextlib.AbstractContextManager] | None = None, *,
                  inputs: Any = None) -> None:
    """``optimizer.step()`` issued as one partial step per entry of ``parts`` (disjoint lists of
    the *model* parameters the optimizer was built over), each inside ``around(i)``.

    For :class:`mixprec.optim.MasterWeights` (and AdamW) each part steps its FP32 masters and
    copies them back into its 16-bit parameters, with ``inputs`` (its
    :class:`~mixprec.optim.inputs.StepInputs`, or None). Parameters in no part are not stepped.
    """
    check_separable(optimizer)
    if hasattr(optimizer, "master_of") and hasattr(optimizer, "inner"):
        optimizer.step(parts=parts, around=around, inputs=inputs)
        return
    if inputs is not None:
        raise TypeError("StepInputs are for mixprec's master-weight optimizers; "
                        f"{type(optimizer).__name__}.step() takes none")
    whole = optimizer.param_groups
    try:
        for i, part in enumerate(parts):
            with (around(i) if around is not None else contextlib.nullcontext()):
                optimizer.param_groups = restricted_groups(whole, part)
                optimizer.step()
    finally:
        optimizer.param_groups = whole
