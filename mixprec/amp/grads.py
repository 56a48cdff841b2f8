"""The grad protocol of docs/CONTRACTS.md, declared: what an optimizer may offer the scaler and
the clip besides the ``.grad`` of its ``param_groups``.

Why here, as ``typing.Protocol`` classes: the scaler is a room below the optimizers
(tests/test_layers.py), so it cannot name ``mixprec.optim.MasterWeights``; a declared protocol
says exactly which methods it relies on, type checkers check implementations against it, and
``isinstance`` against it replaces ad-hoc attribute probes. mixprec's master-weight optimizers
implement both; a third-party optimizer may implement ``master_grads`` alone.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import Tensor

__all__ = ["HasMasterGrads", "HasDeferredGrads"]


@runtime_checkable
class HasMasterGrads(Protocol):
    """An optimizer whose step reads FP32 master gradients it copies from the model's grads."""

    def master_grads(self) -> list[Tensor]:
        """The gradient tensors the step will use (copied once per step): unscale, check or clip
        them in place."""
        ...


@runtime_checkable
class HasDeferredGrads(Protocol):
    """An optimizer that keeps no FP32 copies of some gradients (split masters): the scaler
    checks them as they are and hands it the factors to apply inside the step."""

    def deferred_grads(self) -> Any:
        """A ``mixprec.optim.split.DeferredGrads`` (``low``/``own`` grads, ``scale_(factor_for)``,
        ``norms(norm_type)``), or None when nothing is deferred this step."""
        ...
