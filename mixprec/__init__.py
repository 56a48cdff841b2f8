"""mixprec: mixed-precision training for PyTorch.

The public API is what this module lists in ``__all__``; everything else is internal.
"""
from mixprec import precision
from mixprec.errors import CheckpointError, ConfigError, DataError, MixprecError, NumericsError
from mixprec.precision import Policy, autocast, get_policy

__version__ = "0.1.0"

__all__ = [
    # precision policy
    "Policy", "get_policy", "autocast",
    # errors
    "MixprecError", "ConfigError", "DataError", "CheckpointError", "NumericsError",
    # sub-packages
    "precision",
]
