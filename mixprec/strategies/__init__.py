"""Distributed strategies on torch.distributed: one device, DDP (mirrored) and FSDP2 (sharded).

Launch with ``torchrun``; a process without ``WORLD_SIZE`` runs on one device. See
``docs/distributed.md`` for what ``strategy.scope()`` does and the multi-node launch command.
"""
from mixprec.errors import ConfigError, closest
from mixprec.strategies.base import ProcessGroupStrategy, Strategy, current_strategy
from mixprec.strategies.comm_hooks import COMPRESSIONS, CommCounter, HookState, TopKState, make_hook
from mixprec.strategies.env import (DistEnv, RankFailureError, default_timeout, init_process_group,
                                    rank_failure_guard, read_env)
from mixprec.strategies.mirrored import MirroredStrategy
from mixprec.strategies.single import SingleDeviceStrategy

__all__ = [
    # strategies
    "Strategy", "SingleDeviceStrategy", "MirroredStrategy", "FSDPStrategy", "get_strategy",
    "current_strategy", "STRATEGIES", "ProcessGroupStrategy",
    # launch environment
    "DistEnv", "read_env", "init_process_group", "default_timeout", "RankFailureError",
    "rank_failure_guard",
    # gradient compression
    "COMPRESSIONS", "make_hook", "HookState", "TopKState", "CommCounter",
    # fsdp helpers
    "fsdp_mixed_precision", "default_shard_units",
]


# FSDP2 (``torch.distributed.fsdp``, and with it DTensor) takes about a second to import: it is
# loaded when first named, not by every ``import mixprec`` (each CLI call, each torchrun worker).
_FSDP_NAMES = ("FSDPStrategy", "default_shard_units", "fsdp_mixed_precision")


def __getattr__(name: str):
    if name in _FSDP_NAMES:
        from mixprec.strategies import fsdp
        return getattr(fsdp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


STRATEGIES = ("auto", "single", "mirrored", "ddp", "fsdp")


def get_strategy(name_or_obj=None, **kwargs):
    """A :class:`~mixprec.strategies.base.Strategy` from a name, an instance or None.

    ``None``/``"auto"``: :class:`MirroredStrategy` when ``WORLD_SIZE > 1`` or DDP settings are
    given, else :class:`SingleDeviceStrategy`. ``"ddp"`` is an alias of ``"mirrored"``. ``kwargs`` go to the
    constructor.
    """
    if isinstance(name_or_obj, Strategy):
        if kwargs:
            raise ConfigError("pass either a strategy object or keyword arguments, not both")
        return name_or_obj
    name = "auto" if name_or_obj is None else str(name_or_obj).lower()
    if name == "auto":  # DDP settings (grad_compression=...) need the class that takes them; in
        # one process MirroredStrategy is a single-device strategy anyway
        name = "mirrored" if read_env().distributed or kwargs else "single"
    classes = {"single": SingleDeviceStrategy, "mirrored": MirroredStrategy,
               "ddp": MirroredStrategy, "fsdp": "FSDPStrategy"}     # imported when asked for
    if name not in classes:
        raise ConfigError(f"unknown strategy {name_or_obj!r}; valid: {', '.join(STRATEGIES)}"
                          + closest(name, STRATEGIES))
    cls = classes[name]
    if isinstance(cls, str):
        cls = __getattr__(cls)
    if kwargs.get("grad_compression") not in (None, "none") and not cls.compresses_gradients:
        raise ConfigError(f"grad_compression={kwargs['grad_compression']} needs strategy=ddp (or auto): "
                          f"it is a DDP communication hook, and strategy={name} has none")
    return cls(**kwargs)
