"""The `Strategy` interface: where a model runs, how its gradients meet, how its state is saved.

A strategy answers every question the training step has about "the other processes":

* where tensors live (``device``, :meth:`Strategy.to_device`),
* who this process is (``rank``, ``local_rank``, ``world_size``, ``is_main``),
* how the model and optimizer are wrapped (:meth:`Strategy.setup`),
* when gradients are synchronised (:meth:`Strategy.no_sync` for accumulation micro-steps),
* how metrics and decisions are agreed (:meth:`Strategy.reduce_mean`, :meth:`Strategy.reduce_max`,
  :meth:`Strategy.all_reduce_max`),
* how a full checkpoint is gathered and restored (:meth:`Strategy.model_state_dict`, ...),
* what the gradient traffic cost (:meth:`Strategy.comm_stats`).

``scope()`` (the ``with strategy.scope():`` idiom of the source article, docs/sources.md) does
exactly two things and nothing hidden: it makes the strategy's device the default device for
tensors and modules created inside (``torch.device`` as a context manager), and it makes the
strategy the *current strategy*, which :func:`current_strategy` returns (so
``DistributedDataLoader`` and ``fit()`` can find it without being passed it). It does **not**
wrap models: wrapping (DDP, ``fully_shard``) happens in :meth:`Strategy.setup`, which ``fit()``
calls for you. Wrapping at construction time would need to intercept every
``nn.Module.__init__``; an explicit call is easier to reason about.
"""
from __future__ import annotations

import atexit
import contextlib
import contextvars
import gc
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mixprec.errors import excerpt
from mixprec.precision import Precision
from mixprec.precision import Policy
from mixprec.strategies.env import (DistEnv, default_backend, default_timeout, init_process_group,
                                    rank_failure_guard, read_env)

__all__ = ["Strategy", "ProcessGroupStrategy", "current_strategy", "OptimizerLike"]

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
    compresses_gradients: bool = False
    """Takes ``grad_compression=`` (a DDP communication hook): a capability, asked instead of a name."""

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
        """Move every tensor in a (nested tuple/list/dict) batch to ``device``; an object with a
        ``.to()`` method moves itself.

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
        if callable(getattr(batch, "to", None)):   # a batch object of the user's own: its .to()
            return batch.to(self.device)
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

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """Element-wise max of ``t`` over all ranks, as a new tensor (one collective; a copy in
        one process). For decisions every rank must take alike (the training guard's votes)."""
        t = t.detach().to(self._comm_device()).clone()
        if self.is_distributed:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` as rank ``src`` has it, on every rank (a picklable Python value; host side)."""
        if not self.is_distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

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


class ProcessGroupStrategy:
    """Mixin for strategies that join a process group: reads the env, picks the device, inits.

    One process (no ``WORLD_SIZE``) is valid and makes the strategy a single-device one: no
    process group, no wrapping, reductions are the identity.
    """

    def _init_distributed(self, *, device: torch.device | str | None, backend: str | None,
                          timeout: float | None) -> tuple[DistEnv, torch.device]:
        env = read_env()
        if device is None:
            if torch.cuda.is_available():
                device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
            else:
                device = torch.device("cpu")
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.timeout = default_timeout() if timeout is None else float(timeout)
        self.backend = backend or default_backend(device)
        self._owns_group = init_process_group(env, device, backend=self.backend, timeout=self.timeout)
        if self._owns_group:
            # Whoever holds this strategy, the group it created ends before interpreter shutdown.
            atexit.register(self._teardown_at_exit)
        if dist.is_initialized():  # also when the caller created the group itself
            env = DistEnv(rank=dist.get_rank(), local_rank=env.local_rank,
                          world_size=dist.get_world_size(), master_addr=env.master_addr,
                          master_port=env.master_port)
        return env, device

    def guard(self):
        """``with strategy.guard():`` around a training step: a lost peer becomes a
        :class:`RankFailureError` naming the timeout and the fix."""
        return rank_failure_guard(self.rank, self.timeout, world_size=self.world_size)

    def teardown(self) -> None:
        """Leave the job cleanly: every rank meets at a barrier, then the group is destroyed.

        Call it on every rank once training is over, after dropping your references to the
        wrapped model (``del model``): DDP's reducer and FSDP's states hold the process group, and
        a group that is still alive when the interpreter exits is destroyed during finalization,
        where gloo's worker threads can abort the process (``terminate called without an active
        exception``) or block forever (2 of 40 `mixprec train` runs before this order, see
        docs/distributed.md). The barrier is bounded by the group's timeout, so a peer that died
        meanwhile ends this rank with :class:`RankFailureError` instead of a hang.
        """
        if not (getattr(self, "_owns_group", False) and dist.is_initialized()):
            return
        gc.collect()   # wrappers that only cycles keep alive release the group now, not at exit
        with self.guard():
            dist.barrier()   # nobody is still inside a collective when the group goes away
        dist.destroy_process_group()
        self._owns_group = False
        atexit.unregister(self._teardown_at_exit)

    def _teardown_at_exit(self) -> None:
        """``atexit``: the group this strategy created is torn down while the interpreter still
        runs, not during its shutdown.

        A script that ends without :meth:`teardown` (the README's example: a strategy passed to
        ``fit()``, then the end of the file) otherwise leaves the group to interpreter
        finalization, where gloo's threads can abort the process (``terminate called without an
        active exception``, exit -6 after a successful run: 3 of 70 two-rank launches) or block
        it. Here the wrappers only cycles keep alive are collected, every rank meets at a
        barrier bounded by the group's timeout, and the group is destroyed. A process that is
        ending on an uncaught exception skips all of it: its peers may be inside another
        collective, and a broken group can block its own destruction.
        """
        if getattr(sys, "last_value", None) is not None:   # set when Python printed a traceback
            return
        try:
            self.teardown()
        except Exception as exc:   # a peer died meanwhile: say so in one line, let the exit go on
            first = excerpt(exc)
            print(f"mixprec: rank {self.rank}: could not end the process group at exit: {first}",
                  file=sys.stderr)
