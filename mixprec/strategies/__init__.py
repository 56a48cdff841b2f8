"""Distributed strategies on torch.distributed: one device, DDP (mirrored) and FSDP2 (sharded).

Launch with ``torchrun``; a process without ``WORLD_SIZE`` runs on one device. See
``docs/distributed.md`` for what ``strategy.scope()`` does and the multi-node launch command.
"""
from mixprec.strategies.base import Strategy, current_strategy
from mixprec.strategies.comm_hooks import COMPRESSIONS, CommCounter, HookState, TopKState, make_hook
from mixprec.strategies.env import (STRATEGIES, DistEnv, RankFailureError, default_timeout, get_strategy,
                                    init_process_group, rank_failure_guard, read_env)
from mixprec.strategies.fsdp import FSDPStrategy, default_shard_units, fsdp_mixed_precision
from mixprec.strategies.mirrored import MirroredStrategy
from mixprec.strategies.single import SingleDeviceStrategy

__all__ = [
    # strategies
    "Strategy", "SingleDeviceStrategy", "MirroredStrategy", "FSDPStrategy", "get_strategy",
    "current_strategy", "STRATEGIES",
    # launch environment
    "DistEnv", "read_env", "init_process_group", "default_timeout", "RankFailureError",
    "rank_failure_guard",
    # gradient compression
    "COMPRESSIONS", "make_hook", "HookState", "TopKState", "CommCounter",
    # fsdp helpers
    "fsdp_mixed_precision", "default_shard_units",
]
