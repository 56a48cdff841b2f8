"""`MirroredStrategy`: one full model replica per process, gradients averaged by DDP.

Under ``torchrun`` each process holds the whole model; ``DistributedDataParallel`` broadcasts
rank 0's parameters at wrap time and averages gradients during backward, bucket by bucket, while
later layers are still differentiating. A communication hook from
:mod:`mixprec.strategies.comm_hooks` carries each bucket (plain, FP16, BF16 or top-k), and counts
the bytes.

Overflow decisions: DDP averages gradients before the optimizer sees them, so an inf produced on
any rank *during backward* reaches every rank. An inf that appears on one rank after the
all-reduce (or with ``no_sync``) is caught by ``mixprec.amp.GradScaler``, which all-reduces
``found_inf`` with MAX, so every rank skips together and the loss scales stay identical. After
the all-reduce every rank holds the same gradients, so a local gradient norm is the global one.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mixprec.errors import ConfigError, closest
from mixprec.strategies.base import ProcessGroupStrategy, Strategy
from mixprec.strategies.comm_hooks import COMPRESSIONS, HookState, TopKState, make_hook

__all__ = ["MirroredStrategy"]

_BY_REDUCE_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "none"}


class MirroredStrategy(ProcessGroupStrategy, Strategy):
    """Data parallelism with DDP; one process without ``WORLD_SIZE`` is a single-device run.

    Args:
        grad_compression: ``"none"``, ``"fp16"``, ``"bf16"`` or ``"topk"``; ``None`` follows the
            policy's ``reduce_dtype`` given to :meth:`setup` (FP32 -> ``"none"``).
        topk_ratio: fraction of gradient values sent per step with ``"topk"``.
        backend: ``"gloo"``/``"nccl"``; default NCCL on CUDA, gloo on CPU.
        timeout: seconds a collective waits for a peer (default ``MIXPREC_DIST_TIMEOUT`` or 300).
        device: default ``cuda:LOCAL_RANK`` when CUDA exists, else the CPU.
        find_unused_parameters, bucket_cap_mb, static_graph: passed to DDP.
    """

    name = "mirrored"

    compresses_gradients = True

    def __init__(self, grad_compression: str | None = None, topk_ratio: float = 0.3, *,
                 backend: str | None = None, timeout: float | None = None,
                 device: torch.device | str | None = None, find_unused_parameters: bool = False,
                 bucket_cap_mb: float = 25.0, static_graph: bool = False) -> None:
        if grad_compression is not None and grad_compression not in COMPRESSIONS:
            raise ConfigError(f"unknown grad_compression {grad_compression!r}; valid: "
                              f"{', '.join(COMPRESSIONS)}" + closest(grad_compression, COMPRESSIONS))
        if not 0.0 < topk_ratio <= 1.0:
            raise ConfigError(f"topk_ratio must be in (0, 1], got {topk_ratio}")
        if bucket_cap_mb <= 0:
            raise ConfigError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        env, dev = self._init_distributed(device=device, backend=backend, timeout=timeout)
        Strategy.__init__(self, device=dev, rank=env.rank, local_rank=env.local_rank,
                          world_size=env.world_size)
        self.grad_compression = grad_compression
        self.topk_ratio = topk_ratio
        self.find_unused_parameters = find_unused_parameters
        self.bucket_cap_mb = bucket_cap_mb
        self.static_graph = static_graph
        self.hook_states: list[HookState] = []

    @property
    def compression(self) -> str:
        """The compression in effect: the explicit choice, else the policy's reduce dtype."""
        if self.grad_compression is not None:
            return self.grad_compression
        return _BY_REDUCE_DTYPE[self.precision.recipe.reduce_dtype] if self.precision is not None else "none"

    def _wrap(self, model: nn.Module) -> nn.Module:
        if not self.is_distributed or isinstance(model, DistributedDataParallel):
            return model
        ddp = DistributedDataParallel(
            model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            find_unused_parameters=self.find_unused_parameters, bucket_cap_mb=self.bucket_cap_mb,
            static_graph=self.static_graph)
        state, hook = make_hook(self.compression, topk_ratio=self.topk_ratio)
        if isinstance(state, TopKState):  # residual layouts keyed by parameter position
            state.param_index = {p.data_ptr(): i for i, p in enumerate(model.parameters())}
        ddp.register_comm_hook(state, hook)
        self.hook_states.append(state)
        return ddp

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """DDP's ``no_sync``: gradients accumulate locally; the next synced backward sends the sum."""
        return model.no_sync() if isinstance(model, DistributedDataParallel) else contextlib.nullcontext()

    def comm_stats(self) -> dict[str, float]:
        """Counters summed over the wrapped models, plus ``compression`` and ``density``."""
        total = super().comm_stats() | {"wire_bytes": 0.0}
        for state in self.hook_states:
            for key, value in state.counter.as_dict().items():
                total[key] += value
        total["density"] = total["values_sent"] / total["values_dense"] if total["values_dense"] else 1.0
        total["compression"] = self.compression
        return total

    # --- error-feedback state in checkpoints --------------------------------------------------

    def comm_state_dict(self) -> dict:
        """Every rank's hook state (top-k residuals, counters), gathered to rank 0.

        Call on every rank; the result is complete on rank 0 (``{"per_rank": [...]}``), empty
        elsewhere. Residuals differ per rank, so all of them are saved.
        """
        local = [s.state_dict() for s in self.hook_states]
        if not self.is_distributed:
            return {"per_rank": [local]}
        import torch.distributed as dist
        gathered = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(local, gathered, dst=0)
        return {"per_rank": gathered} if self.rank == 0 else {}

    def load_comm_state_dict(self, state: dict | None) -> None:
        """Restore this rank's slice of :meth:`comm_state_dict` (after :meth:`setup`)."""
        state = self._share_from_main(state if state else None)
        per_rank = state["per_rank"]
        if len(per_rank) != self.world_size:
            raise ConfigError(f"the checkpoint's gradient-compression state is for {len(per_rank)} "
                              f"ranks but this job has {self.world_size}; resume with the same "
                              "number of processes or drop the residuals (start them at zero)")
        mine = per_rank[self.rank]
        if len(mine) != len(self.hook_states):
            raise ConfigError("gradient-compression state does not match the wrapped models; "
                              "call load_comm_state_dict after setup()")
        for hook_state, sd in zip(self.hook_states, mine, strict=True):
            hook_state.load_state_dict(sd)

    # the names the trainer's checkpoint code looks for
    state_dict = comm_state_dict
    load_state_dict = load_comm_state_dict
