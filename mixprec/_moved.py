"""Old import paths, retired in 0.4: each fails in one line naming its new home.

:data:`MOVED_MODULES` (module paths) are refused by :class:`MovedFinder`, the first finder on
``sys.meta_path`` once ``mixprec`` is imported: no module is kept at an old path. :data:`MOVED_NAMES`
(names a package no longer holds), and old modules named as attributes, are refused by the
package's ``__getattr__`` through :func:`refuse`. CHANGELOG.md's migration table lists the same
paths (tests/test_moved.py checks both).
"""
from __future__ import annotations

import importlib.abc
import sys

__all__ = ["MOVED_MODULES", "MOVED_NAMES", "MovedFinder", "MovedPathError", "install", "refuse"]

RELEASE = "0.4"

MOVED_MODULES = {
    # shim packages
    "mixprec.fp8": "mixprec.formats",
    "mixprec.fp8.config": "mixprec.formats.fp8_config",
    "mixprec.fp8.convert": "mixprec.precision.convert",
    "mixprec.fp8.emulation": "mixprec.formats.emulation",
    "mixprec.fp8.linear": "mixprec.formats.fp8_linear",
    "mixprec.fp8.quantize": "mixprec.formats.fp8_quantize",
    "mixprec.engine": "mixprec.precision (Precision, OptimizerSpec) and mixprec.optim (OverlappedUpdate)",
    "mixprec.engine.precision": "mixprec.precision.precision",
    "mixprec.engine.layer_formats": "mixprec.precision.layer_formats",
    "mixprec.engine.overlap": "mixprec.optim.overlap",
    # module paths that were aliased to their new room
    "mixprec.precision.dtypes": "mixprec.policy.dtypes",
    "mixprec.precision.exempt": "mixprec.precision.rules",
    "mixprec.precision.hardware": "mixprec.policy.hardware",
    "mixprec.precision.overrides": "mixprec.policy.overrides",
    "mixprec.precision.peak": "mixprec.policy.peak",
    "mixprec.precision.policy": "mixprec.policy.policy",
    "mixprec.train.checkpoint": "mixprec.runs.checkpoint",
    "mixprec.train.resume": "mixprec.runs.checkpointer",
    "mixprec.train.events": "mixprec.runs.events",
    "mixprec.train.metrics": "mixprec.runs.metrics",
    "mixprec.train.run_dir": "mixprec.runs.run_dir",
    "mixprec.train.hf": "mixprec.models.hf",
    "mixprec.train.objective": "mixprec.models.objective",
    "mixprec.train.schedule": "mixprec.optim.schedule",
    # moved in 0.4 so that the core never imports a tool (docs/ARCHITECTURE.md)
    "mixprec.formats.mx_convert": "mixprec.precision.convert",
    "mixprec.estimate.flops": "mixprec.models.flops",
    "mixprec.plan.guard": "mixprec.monitor.guard",
    "mixprec.plan.guard_state": "mixprec.monitor.guard_state",
    "mixprec.plan.replan": "mixprec.monitor.replan",
    "mixprec.plan.gates": "mixprec.monitor.gates",
    # FP8 and micro-format conversion in one module, one walk, one report type (#38, item 3)
    "mixprec.precision.fp8_convert": "mixprec.precision.convert",
    "mixprec.precision.mx_convert": "mixprec.precision.convert",
}
"""Old module path -> its new home."""

MOVED_NAMES = {
    # lazily re-exported from a room above, until 0.4
    "mixprec.amp.autocast": "mixprec.precision.autocast",
    "mixprec.formats.convert_to_fp8": "mixprec.precision.convert_to_fp8",
    "mixprec.formats.prepare_fp8": "mixprec.precision.prepare_fp8",
    "mixprec.formats.Fp8ConversionReport": "mixprec.precision.ConversionReport",
    # the conversion to micro formats moved to the decider, beside the FP8 conversion
    "mixprec.formats.convert_to_micro": "mixprec.precision.convert_to_micro",
    "mixprec.formats.MicroConversionReport": "mixprec.precision.ConversionReport",
    "mixprec.formats.block_index": "mixprec.precision.block_index",
    # one report type for both conversions (#38, item 3)
    "mixprec.precision.Fp8ConversionReport": "mixprec.precision.ConversionReport",
    "mixprec.precision.MicroConversionReport": "mixprec.precision.ConversionReport",
    # training-time re-planning and the guard are the core's (mixprec.monitor), planning is a tool
    "mixprec.plan.LayerReplanner": "mixprec.monitor.LayerReplanner",
    "mixprec.plan.FormatSwitch": "mixprec.monitor.FormatSwitch",
    "mixprec.plan.TrainingGuard": "mixprec.monitor.TrainingGuard",
    "mixprec.plan.GuardConfig": "mixprec.monitor.GuardConfig",
    # tools are no longer named by the top-level package (import mixprec loads the core only)
    "mixprec.plan_precision": "mixprec.plan.plan_precision",
    "mixprec.what_if": "mixprec.plan.what_if",
}
"""Old ``package.name`` -> its new home."""


class MovedPathError(ModuleNotFoundError):
    """An import of a path retired in 0.4. ``old`` and ``new`` name both ends; ``name`` is None so
    that ``from package import old_module`` reports this line, not a bare "cannot import name"."""

    def __init__(self, old: str, new: str) -> None:
        super().__init__(f"{old} moved to {new} in {RELEASE}; see CHANGELOG.md")
        self.old, self.new = old, new


class MovedFinder(importlib.abc.MetaPathFinder):
    """Refuses the module paths of :data:`MOVED_MODULES`; every other import passes on."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED_MODULES.get(fullname)
        if new is not None:
            raise MovedPathError(fullname, new)
        return None


def install() -> None:
    """Put one :class:`MovedFinder` first on ``sys.meta_path`` (first: a stale folder left at an
    old path must not import as a namespace package)."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())


def refuse(package: str, name: str):
    """A package's ``__getattr__``: :class:`MovedPathError` for a name of :data:`MOVED_NAMES` or
    a module of :data:`MOVED_MODULES` named as an attribute (``mixprec.train.metrics``; an
    ImportError, so ``from package import name`` shows it), AttributeError otherwise."""
    old = f"{package}.{name}"
    new = MOVED_NAMES.get(old) or MOVED_MODULES.get(old)
    if new is not None:
        raise MovedPathError(old, new)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
