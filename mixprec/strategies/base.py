"""The `Strategy` interface: where a model runs, how its gradients meet, how its state is saved.

A strategy answers every question the training step has about "the other processes":

* where tensors live (``device``, :meth:`Strategy.to_device`),
* who this process is (``rank``, ``local_rank``, ``world_size``, ``is_main``),
* how the model and optimizer are wrapped (:meth:`Strategy.setup`),
* when gradients are synchronised (:meth:`Strategy.no_sync` for accumulation micro-steps),
* how metrics are agreed (:meth:`Strategy.reduce_mean`, :meth:`Strategy.reduce_max`),
* how a full checkpoint is gathered and restored (:meth:`Strategy.model_state_dict`, ...),
* what the gradient traffic cost (:meth:`Strategy.comm_stats`).

``scope()`` (the seed's ``with strategy.scope():`` idiom) does exactly two things and nothing
hidden: it makes the strategy's device the default device for tensors and modules created inside
(``torch.device`` as a context manager), and it makes the strategy the *current strategy*, which
:func:`current_strategy` returns (so ``DistributedDataLoader`` and ``fit()`` can find it without
being passed it). It does **not** wrap models: wrapping (DDP, ``fully_shard``) happens in
:meth:`Strategy.setup`, which ``fit()`` calls for you. Wrapping at construction time would need
to intercept every ``nn.Module.__init__``; an explicit call is easier to reason about.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mixprec.engine import Precision
from mixprec.precision import Policy

__all__ = ["Strategy", "current_strategy", "OptimizerLike"]

OptimizerLike = torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None
"""An optimizer, or a factory ``params -> optimizer`` (needed by strategies that replace params)."""

_CURRENT: contextvars.ContextVar[list["Strategy"]] = contextvars.ContextVar("mixprec_strategy",
                                                                          default=[])


def current_strategy() -> "Strategy | None":
    """The strategy of the innermost active ``strategy.scope()``, or None outside any scope."""
    stack = _CURRENT.get()
    return stack[-1] if stack else None


class Strategy:
    """Base class; subclasses set ``device``/``rank``/... and override the wrapping hooks.

    The defaults implement one process on one device: every reduction is the identity, and the
    state-dict helpers read the (unwrapped) module directly.
    """

    name: str = "base"

    def __init__(self, *, device: torch.device, rank: int = 0, local_rank: int = 0,
                 world_size: int = 1) -> None:
        self.device = torch.device(device)
        self.rank = int(rank)
        self.local_rank = int(local_rank)
        self.world_size = int(world_size)
        self.precision: Precision | None = None

    # --- who am I -----------------------------------------------------------------------------

    @property
    def is_main(self) -> bool:
        """True on global rank 0: the only process that prints progress and writes files."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """True when a process group with more than one rank is active."""
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(device={self.device}, rank={self.rank}/{self.world_size}, "
                f"local_rank={self.local_rank})")

    # --- scope and setup ----------------------------------------------------------------------

    @contextlib.contextmanager
    def scope(self) -> Iterator["Strategy"]:
        """Default device = ``self.device`` and ``current_strategy() is self`` inside the block.

        Nests; the previous default device and current strategy come back on exit, also on error.
        Tensors created with an explicit ``device=`` are unaffected.
        """
        token = _CURRENT.set([*_CURRENT.get(), self])
        try:
            with torch.device(self.device):
                yield self
        finally:
            _CURRENT.reset(token)

    @property
    def policy(self) -> Policy | None:
        """The policy of the :class:`~mixprec.Precision` given to :meth:`setup` (or None)."""
        return self.precision.policy if self.precision is not None else None

    @property
    def shards_parameters(self) -> bool:
        """True when :meth:`setup` replaces parameters with shards (FSDP2 across ranks): their FP32
        shards are then the master weights."""
        return False

    def _use_precision(self, precision: Precision | Policy | str | None,
                       policy: Policy | str | None) -> None:
        choice = precision if precision is not None else policy
        if choice is not None:
            self.precision = choice if isinstance(choice, Precision) else Precision(choice, device=self.device)

    def setup(self, model: nn.Module, optimizer: OptimizerLike = None, *,
              precision: Precision | Policy | str | None = None,
              policy: Policy | str | None = None) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """Place and wrap ``model`` for this strategy; return ``(wrapped_model, optimizer)``.

        ``optimizer`` may be an optimizer built on ``model.parameters()`` or a factory called
        with the parameters the strategy ends up with (FSDP replaces parameters with sharded
        ones). ``precision`` (a :class:`~mixprec.Precision`; ``policy`` is the older spelling)
        tells strategies the reduce dtype and, for FSDP2, the gather dtypes.
        """
        self._use_precision(precision, policy)
        model = model.to(self.device)
        wrapped = self._wrap(model)
        return wrapped, self._make_optimizer(wrapped, optimizer)

    def _wrap(self, model: nn.Module) -> nn.Module:
        return model

    def _make_optimizer(self, model: nn.Module,
                        optimizer: OptimizerLike) -> torch.optim.Optimizer | None:
        if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        if hasattr(optimizer, "param_groups") and hasattr(optimizer, "step"):
            return optimizer  # optimizer-like wrapper (e.g. mixprec.optim.MasterWeights)
        return optimizer(self.unwrap(model).parameters())

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside any wrapper (DDP's ``.module``); FSDP2 modules are their own."""
        return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model

    # --- the training step's questions --------------------------------------------------------

    def to_device(self, batch: Any) -> Any:
        """Move every tensor in a (nested tuple/list/dict) batch to ``device``.

        Copies are ``non_blocking`` on CUDA: with pinned host memory the copy overlaps compute,
        and the first kernel reading the tensor orders itself after the copy on the same stream.
        """
        non_blocking = self.device.type == "cuda"
        if isinstance(batch, torch.Tensor):
            return batch.to(self.device, non_blocking=non_blocking)
        if isinstance(batch, Mapping):
            return type(batch)({k: self.to_device(v) for k, v in batch.items()})
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
            return type(batch)(*(self.to_device(v) for v in batch))
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.to_device(v) for v in batch)
        return batch

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Context for accumulation micro-steps: backward runs, no gradient communication."""
        return contextlib.nullcontext()

    def reduce_mean(self, x: torch.Tensor | float) -> float:
        """Mean of a scalar over all ranks, as a Python float (a host sync: for metrics only)."""
        return self._reduce(x, dist.ReduceOp.SUM) / self.world_size

    def reduce_max(self, x: torch.Tensor | float) -> float:
        """Max of a scalar over all ranks, as a Python float (a host sync: for metrics only)."""
        return self._reduce(x, dist.ReduceOp.MAX)

    def _reduce(self, x: torch.Tensor | float, op: dist.ReduceOp) -> float:
        t = torch.as_tensor(x, dtype=torch.float64 if self.device.type == "cpu" else torch.float32)
        t = t.detach().to(self.device).reshape(())
        if self.is_distributed:
            t = t.clone()
            dist.all_reduce(t, op=op)
        return float(t.item())

    def barrier(self) -> None:
        """Wait for every rank (a no-op in one process)."""
        if self.is_distributed:
            dist.barrier()

    # --- checkpoints: full state, rank 0 writes -----------------------------------------------

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full (unsharded) model state on CPU. Complete on rank 0; write it only there.

        Call it on every rank: sharded strategies gather collectively.
        """
        # Tied weights (an output head sharing the embedding's tensor) stay one tensor in the
        # copy, so the checkpoint stores them once and records the alias.
        copies: dict[tuple, torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        for k, v in self.unwrap(model).state_dict().items():
            v = v.detach()
            view = (v.device, v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape),
                    tuple(v.stride()), v.dtype)
            if not v.numel() or view not in copies:       # empty tensors share no data
                copies[view] = v.to("cpu", copy=True)
            out[k] = copies[view]
        return out

    def load_model_state_dict(self, model: nn.Module, state: Mapping[str, torch.Tensor] | None) -> None:
        """Load a full state into every rank. Call on every rank; ranks that could not read the
        checkpoint pass None and receive rank 0's copy."""
        state = self._share_from_main(state)
        self.unwrap(model).load_state_dict(state)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The full optimizer state (complete on rank 0). Call on every rank."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: Mapping | None) -> None:
        """Inverse of :meth:`optimizer_state_dict`; ranks without the file pass None."""
        optimizer.load_state_dict(self._share_from_main(state))

    def _share_from_main(self, state: Any) -> Any:
        """Return ``state`` as rank 0 holds it: local when every rank has one, else broadcast."""
        if not self.is_distributed:
            if state is None:
                raise ValueError("no state to load (state is None in a single process)")
            return state
        flag = torch.tensor([0.0 if state is None else 1.0], device=self._comm_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item() == 1.0:
            return state
        box = [state if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, device=self._comm_device())
        if box[0] is None:
            raise ValueError("rank 0 has no state to share (it passed None)")
        return box[0]

    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    # --- bookkeeping --------------------------------------------------------------------------

    def comm_stats(self) -> dict[str, float]:
        """Gradient traffic so far: payload bytes this rank put into collectives vs dense FP32-like
        bytes it would have sent uncompressed (``bytes_sent``, ``bytes_dense``, ...)."""
        return {"bytes_sent": 0, "bytes_dense": 0, "values_sent": 0, "values_dense": 0,
                "collectives": 0}

    def guard(self) -> contextlib.AbstractContextManager:
        """Context around a training step that turns a lost peer into a one-line error
        (``RankFailureError``); nothing to guard in one process."""
        return contextlib.nullcontext()

    def teardown(self) -> None:
        """Release resources (the process group, if this strategy created it)."""
