"""mixprec: mixed-precision training for PyTorch.

The public API is what this module lists in ``__all__``, and the sub-packages (each lists its own);
names that start with ``_`` and modules not re-exported are internal. ``import mixprec`` loads only
this file, the errors and the version: each name below (and each sub-package, ``mixprec.formats``)
is imported when first named, and every one of them is the core library's (docs/ARCHITECTURE.md).
The tools (``mixprec.plan``, ``mixprec.estimate``, ``mixprec.report``, ``mixprec.bench``,
``mixprec.integrations``, ``mixprec.cli``) import the core, never the reverse.

Import paths retired in 0.4 (``mixprec.fp8``, ``mixprec.engine``, ``mixprec.train.checkpoint``, ...)
fail in one line naming their new home (:mod:`mixprec._moved`, CHANGELOG.md). ``dir(mixprec)`` lists
the public names and the sub-packages; the helpers of this file start with ``_``.
"""
from importlib import import_module as _import_module

from mixprec import _moved
from mixprec._version import __version__
from mixprec.errors import CheckpointError, ConfigError, DataError, MixprecError, NumericsError

_moved.install()

_HOMES = {
    # precision: the policy (data) and the Precision object (every decision)
    "Precision": "mixprec.precision", "Policy": "mixprec.policy", "get_policy": "mixprec.policy",
    "autocast": "mixprec.precision", "cast_module": "mixprec.precision",
    # loss scaling
    "GradScaler": "mixprec.amp",
    # training
    "Trainer": "mixprec.train", "fit": "mixprec.train", "FitConfig": "mixprec.train",
    "TrainConfig": "mixprec.train",
    # models
    "Transformer": "mixprec.models", "TransformerConfig": "mixprec.models",
    # strategies (FSDP2 is slow to import: it is loaded only when FSDPStrategy is named)
    "SingleDeviceStrategy": "mixprec.strategies", "MirroredStrategy": "mixprec.strategies",
    "FSDPStrategy": "mixprec.strategies",
    # run folders: the one way back in
    "read_run": "mixprec.runs",
}
"""Each public name -> the core package that holds it."""

_CORE = ("policy", "amp", "optim", "nn", "formats", "precision", "models", "data", "strategies",
         "monitor", "runs", "train")
"""The library's rooms, lowest first (docs/ARCHITECTURE.md)."""

_TOOLS = ("estimate", "plan", "integrations", "report", "bench", "cli")
"""Rooms that use the library (they import the core; the core never imports them)."""

__all__ = [
    *_HOMES,
    # errors
    "MixprecError", "ConfigError", "DataError", "CheckpointError", "NumericsError",
]


def __getattr__(name: str):
    if name in _HOMES:
        value = getattr(_import_module(_HOMES[name]), name)
        globals()[name] = value                 # once: later lookups are plain attribute reads
        return value
    if name in _CORE or name in _TOOLS:         # ``mixprec.formats`` without ``import mixprec.formats``
        return _import_module(f"{__name__}.{name}")
    _moved.refuse(__name__, name)


def __dir__() -> list[str]:
    """The public names, the sub-packages and the module's dunders (``__version__``), not the
    helpers or modules this file imports."""
    return sorted({*(n for n in globals() if n.startswith("__")), *__all__, *_CORE, *_TOOLS})
