"""mixprec: mixed-precision training for PyTorch.

The public API is what this module lists in ``__all__`` plus the sub-packages; names that start
with ``_`` and modules not re-exported here are internal.
"""
from mixprec import (amp, data, engine, fp8, integrations, models, monitor, nn, optim, precision,
                     strategies, train)
from mixprec.amp import GradScaler
from mixprec.engine import Precision
from mixprec.errors import CheckpointError, ConfigError, DataError, MixprecError, NumericsError
from mixprec.models import Transformer
from mixprec.precision import Policy, autocast, cast_module, get_policy
from mixprec.strategies import FSDPStrategy, MirroredStrategy, SingleDeviceStrategy
from mixprec.train import FitConfig, Trainer, TrainConfig, fit
from mixprec.plan import plan_precision

__version__ = "0.1.0"

__all__ = [
    # precision: the policy (data) and the Precision object (every decision)
    "Precision", "Policy", "get_policy", "autocast", "cast_module",
    # loss scaling
    "GradScaler",
    # training
    "Trainer", "fit", "FitConfig", "TrainConfig",
    # per-layer precision planning
    "plan_precision",
    # models
    "Transformer",
    # strategies
    "SingleDeviceStrategy", "MirroredStrategy", "FSDPStrategy",
    # errors
    "MixprecError", "ConfigError", "DataError", "CheckpointError", "NumericsError",
    # sub-packages
    "precision", "amp", "optim", "nn", "fp8", "engine", "models", "data", "strategies", "monitor", "train",
    "integrations",   # lightning / transformers: import mixprec.integrations.<name> (needs the framework)
]
