"""mixprec: mixed-precision training for PyTorch.

The public API is what this module lists in ``__all__`` plus the sub-packages; names that start
with ``_`` and modules not re-exported here are internal.
"""
from mixprec import (amp, bench, data, engine, estimate, formats, fp8, integrations, models, monitor, nn, optim,
                     plan, policy, precision, report, runs, strategies, train)
from mixprec.amp import GradScaler
from mixprec.precision import Precision
from mixprec.errors import CheckpointError, ConfigError, DataError, MixprecError, NumericsError
from mixprec.models import Transformer
from mixprec.precision import Policy, autocast, cast_module, get_policy
from mixprec.strategies import MirroredStrategy, SingleDeviceStrategy
from mixprec.train import FitConfig, Trainer, TrainConfig, fit
from mixprec.plan import plan_precision, what_if

from mixprec._version import __version__


def __getattr__(name: str):
    if name == "FSDPStrategy":          # imported when first named (FSDP2 is slow to import)
        return strategies.FSDPStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    # precision: the policy (data) and the Precision object (every decision)
    "Precision", "Policy", "get_policy", "autocast", "cast_module",
    # loss scaling
    "GradScaler",
    # training
    "Trainer", "fit", "FitConfig", "TrainConfig",
    # per-layer precision planning
    "plan_precision", "what_if",
    # models
    "Transformer",
    # strategies
    "SingleDeviceStrategy", "MirroredStrategy", "FSDPStrategy",
    # errors
    "MixprecError", "ConfigError", "DataError", "CheckpointError", "NumericsError",
    # sub-packages
    "policy", "amp", "optim", "nn", "formats", "precision", "models", "data", "strategies", "monitor",
    "plan", "runs", "train", "integrations", "report", "estimate", "bench",
    # old paths, kept as re-export shims
    "fp8", "engine",
]
