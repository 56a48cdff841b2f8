"""Which model param has which master, for one :class:`mixprec.optim.MasterWeights`: the masters
made from the params (a separate FP32 master, or the param itself) and how they are stored (here
full FP32 tensors; :class:`mixprec.optim.split_masters.SplitMasters` stores those of BF16 params
split), the FP32 grads of the full ones (mixprec.optim.master_grads), and what the current step
reads."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mixprec.errors import ConfigError
from mixprec.optim import registry
from mixprec.optim.master_grads import copy_grads, zero_grads

__all__ = ["Masters"]


class Masters:
    """The masters of one optimizer's params.

    ``wanted``: the ids of the params that get a separate master (the per-layer table's
    ``master`` column), or None: every floating param not in ``master_dtype``, and with
    ``param_dtype`` every FP32 param the decider did not record as kept FP32 (the rule:
    mixprec.optim.registry.kept_fp32, recorded by ``Precision.setup``, ``cast_module`` and
    ``mark_fp32_params``). ``elementwise``: whether the inner optimizer's step is exact chunk by
    chunk on FP32 masters (the split layout's table splits only then)."""

    split = False
    """Whether this layout stores the masters of BF16 params split (the full layout: never)."""

    def __init__(self, master_dtype: torch.dtype, param_dtype: torch.dtype | None,
                 wanted: set[int] | None, *, elementwise: bool = False) -> None:
        self.master_dtype, self.param_dtype, self.wanted = master_dtype, param_dtype, wanted
        self.elementwise = elementwise
        # Pairs (model param, separate master); self-mastered params are not listed here.
        self.model_params: list[Tensor] = []
        self.masters: list[Tensor] = []
        self.master_of: dict[int, Tensor] = {}  # id(model param) -> master (separate or itself)
        self.model_of: dict[int, Tensor] = {}   # id(separate master) -> model param
        self.all_params: list[Tensor] = []      # flat order of the param groups
        self.grad_of: dict[int, Tensor] = {}    # id(separate master) -> its FP32 grad, allocated once
        self.stepped: tuple[list[Tensor], list[Tensor]] = ([], [])  # (model params, masters) to copy back
        self.grads_ready = False

    def make_group(self, group: dict[str, Any]) -> dict[str, Any]:
        """``group`` with its params replaced by their masters (made here)."""
        masters = []
        for p in group["params"]:
            if id(p) in self.master_of:
                raise ConfigError("a parameter appears twice in the optimizer's param groups; "
                                  "pass each parameter once")
            masters.append(self.make(p))
        return {**group, "params": masters}

    @torch.no_grad()
    def make(self, p: Tensor) -> Tensor:
        """The master of ``p``; with ``param_dtype``, an FP32 ``p`` is converted in place after its
        exact master was taken."""
        if not p.is_leaf:
            raise ConfigError("can't optimize a non-leaf tensor; pass the model's parameters")
        self.all_params.append(p)
        if not p.is_floating_point() or not self.needs_master(p):
            self.master_of[id(p)] = p  # its own master
            return p
        master = p.detach().to(self.master_dtype, copy=True).requires_grad_(p.requires_grad)
        if p.dtype == self.master_dtype:  # convert the model param in place, keep the exact master
            # The one ``.data`` assignment left: the model, the user and their schedulers hold this
            # very Parameter, so its dtype must change in place; ``torch.utils.swap_tensors`` (the
            # other way to keep the object) refuses any tensor with a weak reference (weak-keyed
            # registries, torch.compile's guards), which ``.data`` does not care about.
            p.data = p.data.to(self.param_dtype)
            p.grad = None
        master = self.store(p, master)
        self.model_params.append(p)
        self.masters.append(master)
        self.model_of[id(master)] = p
        self.master_of[id(p)] = master
        return master

    # --- how a master is stored (full FP32 here; the split layout's table overrides these) ---

    def store(self, p: Tensor, exact: Tensor) -> Tensor:
        """The master the inner optimizer steps for ``p``, given its exact value: ``exact``
        itself (a full FP32 tensor)."""
        return exact

    def is_split(self, m: Tensor) -> bool:
        """Whether master ``m`` is stored split (never in this layout)."""
        return False

    def remainder_of(self, m: Tensor) -> Tensor | None:
        """The int16 remainder of a split master (none in this layout)."""
        return None

    @property
    def split_count(self) -> int:
        return 0

    def enter_flat(self, flat: Any) -> None:
        """Before a flat step: what its chunks need from this storage's per-master form (nothing)."""

    def leave_flat(self, flat: Any) -> None:
        """Before a per-master path: the per-master form back from the chunks (nothing here)."""

    def load_own(self, p: Tensor, m: Tensor, saved: Tensor) -> bool:
        """Load a saved FP32 master the layout stores its own way; False: a plain copy does."""
        return False

    def needs_master(self, p: Tensor) -> bool:
        """A separate master for ``p``: the given set decides; without one, its dtype does (and,
        when converting, the decider's record of FP32 islands)."""
        if self.wanted is not None:
            return id(p) in self.wanted and (p.dtype != self.master_dtype or self.param_dtype is not None)
        if p.dtype != self.master_dtype:
            return True
        return self.param_dtype is not None and not registry.kept_fp32(p)

    def reads_model_grad(self, m: Tensor) -> bool:
        """Whether the step reads the model param's own grad for master ``m`` (no FP32 copy)."""
        return False

    def widened(self) -> bool:
        """Whether some master holds FP32 values made for this step only (never here)."""
        return False

    def prepare_grads(self) -> list[Tensor]:
        """Once per step: the grads of full masters copied into their FP32 ``.grad``, what the
        step reads noted (``stepped``); returns the masters whose model grad the step reads itself
        (``reads_model_grad``: none here)."""
        if self.grads_ready:
            return []
        params, masters, deferred = copy_grads(self.model_params, self.masters, self.grad_of,
                                               self.reads_model_grad)
        self.stepped = (params, masters)
        self.grads_ready = True
        return deferred

    def end_step(self) -> None:
        """After a step (taken or skipped) or ``zero_grad``: grads are prepared afresh."""
        self.grads_ready = False
        self.stepped = ([], [])

    def zero_grads(self, set_to_none: bool) -> None:
        zero_grads(self.all_params + self.masters, self.grad_of, set_to_none)

    @torch.no_grad()
    def sync_from_model(self) -> None:
        """The masters overwritten with their model params (after loading model weights only)."""
        full = [(m, p) for p, m in zip(self.model_params, self.masters) if not self.is_split(m)]
        if full:
            torch._foreach_copy_([m for m, _ in full], [p for _, p in full])
