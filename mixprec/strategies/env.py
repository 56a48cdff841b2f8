"""The launch environment: what ``torchrun`` tells each process, and the process group it joins.

``torchrun`` (and ``torch.multiprocessing`` launchers that imitate it) set, per process:

* ``RANK``         global rank, ``0 .. WORLD_SIZE-1``
* ``LOCAL_RANK``   rank on this node (picks the GPU)
* ``WORLD_SIZE``   number of processes in the job
* ``MASTER_ADDR`` / ``MASTER_PORT``  the rendezvous store of the ``env://`` init method

A process without ``WORLD_SIZE`` (or with ``WORLD_SIZE=1``) is a plain single-device run.

The process group is created with a timeout (``MIXPREC_DIST_TIMEOUT`` seconds, default 300):
when a peer dies or hangs, collectives fail after at most that long instead of blocking forever,
and :func:`rank_failure_guard` turns the backend's error into a one-line
:class:`RankFailureError` that says what to do.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mixprec import hints
from mixprec.errors import ConfigError, MixprecError, closest, excerpt

__all__ = ["DistEnv", "RankFailureError", "read_env", "default_timeout", "init_process_group",
           "rank_failure_guard", "default_backend"]

DEFAULT_TIMEOUT_S = 300.0


class RankFailureError(MixprecError, RuntimeError):
    """Another rank crashed, hung or lost the network, so this one cannot continue."""


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    """What the launcher told this process."""

    rank: int = 0
    """Global rank (``RANK``)."""
    local_rank: int = 0
    """Rank on this node (``LOCAL_RANK``); selects ``cuda:LOCAL_RANK``."""
    world_size: int = 1
    """Number of processes (``WORLD_SIZE``)."""
    master_addr: str | None = None
    """Rendezvous host (``MASTER_ADDR``)."""
    master_port: int | None = None
    """Rendezvous port (``MASTER_PORT``)."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"RANK={self.rank} is not in 0..WORLD_SIZE-1 (WORLD_SIZE="
                              f"{self.world_size}); launch with torchrun, which sets both")
        if self.local_rank < 0:
            raise ConfigError(f"LOCAL_RANK={self.local_rank} must be >= 0")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} must be an integer") from None


def read_env() -> DistEnv:
    """Read ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``."""
    world = _int_env("WORLD_SIZE", 1)
    rank = _int_env("RANK", 0)
    port = os.environ.get("MASTER_PORT")
    return DistEnv(rank=rank, local_rank=_int_env("LOCAL_RANK", rank if world > 1 else 0),
                   world_size=world, master_addr=os.environ.get("MASTER_ADDR"),
                   master_port=int(port) if port else None)


def default_timeout() -> float:
    """Seconds a collective may wait for a peer: ``MIXPREC_DIST_TIMEOUT`` or 300."""
    raw = os.environ.get("MIXPREC_DIST_TIMEOUT")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"MIXPREC_DIST_TIMEOUT={raw!r} must be a number of seconds") from None
    if value <= 0:
        raise ConfigError(f"MIXPREC_DIST_TIMEOUT={raw!r} must be > 0 seconds")
    return value


def default_backend(device: torch.device) -> str:
    """NCCL for CUDA devices, gloo for CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(env: DistEnv, device: torch.device, *, backend: str | None = None,
                       timeout: float | None = None) -> bool:
    """Join the default process group unless one exists; return True if this call created it.

    ``timeout`` (seconds) bounds every collective and the rendezvous itself.
    """
    if not env.distributed or dist.is_initialized():
        return False
    if env.master_addr is None or env.master_port is None:
        raise ConfigError(f"WORLD_SIZE={env.world_size} but MASTER_ADDR/MASTER_PORT are not set; "
                          "launch with torchrun (it sets them) or export both")
    backend = backend or default_backend(device)
    if backend not in ("gloo", "nccl", "mpi", "ucc", "xccl"):
        raise ConfigError(f"unknown backend {backend!r}; valid: gloo, nccl"
                          + closest(backend, ("gloo", "nccl")))
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("backend 'nccl' needs CUDA devices; use backend='gloo' on CPU")
    seconds = default_timeout() if timeout is None else float(timeout)
    kwargs = {"device_id": device} if backend == "nccl" else {}
    store = _attempt_store(env, datetime.timedelta(seconds=seconds))
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = "env://"
    dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size,
                            timeout=datetime.timedelta(seconds=seconds), **kwargs)
    return True


def _attempt_store(env: DistEnv, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun's shared store, a store namespace of our own for each restart attempt.

    torchrun (2.x) lets workers use the agent's rendezvous TCPStore (``TORCHELASTIC_USE_AGENT_STORE``)
    and keeps that store across ``--max-restarts`` attempts, but ``env://`` adds no per-attempt
    prefix. The keys where each gloo rank published its address (``default_pg/0//cpu//0/<rank>``,
    seen with ``TCPStore.list_keys()``) survive a worker's death, and a restarted attempt can pick
    up the dead addresses (most likely a rank reading its peer's key before the peer rewrote it):
    ``Gloo connectFullMesh failed ... Connection refused`` and the attempt is lost (4 of 12
    restarts here before this prefix; see docs/distributed.md). Prefixing the keys with
    ``TORCHELASTIC_RESTART_COUNT`` gives every attempt a clean namespace in the same store. None
    (plain ``env://``) outside torchrun or with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(env.master_addr, env.master_port, world_size=env.world_size,
                           is_master=False, timeout=timeout)
    return dist.PrefixStore(f"mixprec/attempt-{attempt}/", client)


_PEER_FAILURE_HINTS = ("connection closed", "connection reset", "timed out", "timeout",
                       "broken pipe", "socket", "gloo", "nccl", "peer", "abort")


@contextlib.contextmanager
def rank_failure_guard(rank: int, timeout: float | None = None, *,
                       world_size: int | None = None) -> Iterator[None]:
    """Turn a collective that failed because a peer died into a one-line :class:`RankFailureError`.

    Errors that do not look like a lost peer (shape bugs, NaN checks, ...) pass through unchanged.
    """
    try:
        yield
    except MixprecError:
        raise
    except (RuntimeError, OSError) as exc:
        text = excerpt(exc)
        is_dist = isinstance(exc, getattr(dist, "DistError", ())) or \
            any(h in text.lower() for h in _PEER_FAILURE_HINTS)
        if not is_dist:
            raise
        limit = f"{timeout:g} s" if timeout else "the process-group timeout"
        raise RankFailureError(
            f"rank {rank}: a collective failed because {_peers(rank, world_size)} crashed, hung or lost the "
            f"network (waited at most {limit}; backend said: {text}); fix the failed rank "
            f"and resume from the last checkpoint: {hints.resume()}") from exc


def _peers(rank: int, world_size: int | None) -> str:
    """Which rank(s) this one was waiting for: every other rank takes part in a collective."""
    if world_size == 2:
        return f"another rank (rank {1 - rank})"
    if world_size:
        return f"another rank (one of 0..{world_size - 1} other than {rank})"
    return "another rank"


_MOVED = {"get_strategy": "mixprec.strategies", "STRATEGIES": "mixprec.strategies",
          "ProcessGroupStrategy": "mixprec.strategies.base"}


def __getattr__(name: str):
    """Old import paths keep working: ``get_strategy``/``STRATEGIES`` now live in
    :mod:`mixprec.strategies`, ``ProcessGroupStrategy`` in :mod:`mixprec.strategies.base`.
    Looked up only when asked for, so this module imports none of its siblings."""
    if name in _MOVED:
        import importlib
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
