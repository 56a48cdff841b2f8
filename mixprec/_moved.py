"""Old import paths, retired in 0.4: each fails in one line naming its new home.

:data:`MOVED_MODULES` (module paths) and :data:`MOVED_NAMES` (names a package no longer holds) are
refused by :class:`MovedFinder`, the first finder on ``sys.meta_path`` once ``mixprec`` is
imported, with :class:`MovedPathError` (a ``ModuleNotFoundError``): no module is kept at an old
path. Named as an attribute (``mixprec.fp8``, ``mixprec.amp.autocast``), the same paths are refused
by the package's ``__getattr__`` through :func:`refuse`, with :class:`MovedAttributeError` (an
``AttributeError``: ``hasattr`` is False, ``getattr``'s default is returned); ``from package import
name`` then asks the finder for ``package.name``, so it shows the line too. A package that was
split (:data:`SPLIT`) is refused before Python looks at what is imported from it, so its line
names the home of each of its names and modules. Members of a class that moved
(:data:`MOVED_MEMBERS`, ``Precision.layer_formats``) are refused the same way by the class's
``__getattr__`` (:func:`refuse_member`). CHANGELOG.md's migration table lists the same paths and
members (tests/test_moved.py checks both).
"""
from __future__ import annotations

import importlib.abc
import sys

__all__ = ["MOVED_MEMBERS", "MOVED_MODULES", "MOVED_NAMES", "SPLIT", "MovedAttributeError", "MovedFinder",
           "MovedPathError", "install", "message", "refuse", "refuse_member"]

RELEASE = "0.4"

SPLIT = {
    "mixprec.fp8": {
        "mixprec.precision": ("convert_to_fp8", "prepare_fp8", "Fp8ConversionReport", "convert_to_micro",
                              "MicroConversionReport", "block_index"),
        "mixprec.formats": (),
    },
    "mixprec.engine": {
        "mixprec.precision": ("Precision", "OptimizerSpec"),
        "mixprec.optim": ("OverlappedUpdate",),
    },
}
"""A retired package whose names went to more than one home: home -> its names (``()``: every
other name the package held)."""


def _homes(split: dict[str, tuple[str, ...]]) -> str:
    return " and ".join(f"{home} ({', '.join(names) or 'every other name'})" for home, names in split.items())


MOVED_MODULES = {
    # shim packages (their names: SPLIT)
    "mixprec.fp8": _homes(SPLIT["mixprec.fp8"]),
    "mixprec.fp8.config": "mixprec.formats.fp8_config",
    "mixprec.fp8.convert": "mixprec.precision.convert",
    "mixprec.fp8.emulation": "mixprec.formats.emulation",
    "mixprec.fp8.linear": "mixprec.formats.fp8_linear",
    "mixprec.fp8.quantize": "mixprec.formats.fp8_quantize",
    "mixprec.engine": _homes(SPLIT["mixprec.engine"]),
    "mixprec.engine.precision": "mixprec.precision.precision",
    "mixprec.engine.layer_formats": "mixprec.precision.layers",
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
    # the per-layer questions and their module surgery in one object, Precision.layers (#38, item 2)
    "mixprec.precision.layer_formats": "mixprec.precision.layers",
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

MOVED_MEMBERS = {
    # the per-layer questions and the model's live layer formats: Precision.layers (#38, item 2)
    "Precision.layer_formats": "Precision.layers.formats",
    "Precision.fp8_report": "Precision.layers.fp8_report",
    "Precision.micro_report": "Precision.layers.micro_report",
    "Precision.table": "Precision.layers.table",
    "Precision.format_counts": "Precision.layers.format_counts",
    "Precision.switched": "Precision.layers.switched",
    "Precision.ran": "Precision.layers.ran",
    "Precision.peak_format": "Precision.layers.peak_format",
    "Precision.range_formats": "Precision.layers.range_formats",
    "Precision.keep_fp32_reason": "Precision.layers.keep_fp32_reason",
    "Precision.keeps_fp32": "Precision.layers.keeps_fp32",
    "Precision.param_dtype_for": "Precision.layers.param_dtype_for",
    "Precision.requested_format": "Precision.layers.requested_format",
    "Precision.format_for": "Precision.layers.format_for",
    "Precision.set_layer_format": "Precision.layers.set_format",
    "Precision.apply_layer_formats": "Precision.layers.restore",
    "Precision.describe_layers": "Precision.layers.describe_lines",
    "Precision.apply_formats": "Precision.layers.apply",
    "Precision.master_params": "Precision.layers.master_params",
    # the recipe's format questions: Precision.recipe (#38, item 2)
    "Precision.matmul_format": "Precision.recipe.matmul_format",
    "Precision.base_format": "Precision.recipe.base_format",
    "Precision.default_format": "Precision.recipe.default_format",
    "Precision.uses_fp8": "Precision.recipe.uses_fp8",
    "Precision.activation_format": "Precision.recipe.activation_format",
    "Precision.gradient_format": "Precision.recipe.gradient_format",
    "Precision.has_plan": "Precision.recipe.has_plan",
    "Precision.label": "Precision.recipe.label",
    "Precision.fp8_recipe": "Precision.recipe.fp8_recipe",
    "Precision.fp8_config": "Precision.recipe.fp8",
    "Precision.micro_formats": "Precision.recipe.micro",
    "Precision.micro_config": "Precision.recipe.micro_config",
    # Precision became a thin face over its recipe and plugins (#38, item 2): the dtype questions
    # are the recipe's, the step's counters the scaler's, the set-up tag module functions, the
    # FSDP2 policies the FSDP2 plugin's
    "Precision.param_dtype": "Precision.recipe.param_dtype",
    "Precision.compute_dtype": "Precision.recipe.compute_dtype",
    "Precision.reduce_dtype": "Precision.recipe.reduce_dtype",
    "Precision.stores_low_precision": "Precision.recipe.stores_low_precision",
    "Precision.keeps_masters": "Precision.recipe.keeps_masters",
    "Precision.loses_small_updates": "Precision.recipe.loses_small_updates",
    "Precision.scales_loss": "Precision.recipe.scales_loss",
    "Precision.autocasts": "Precision.recipe.autocasts",
    "Precision.autocast_copies_weights": "Precision.recipe.autocast_copies_weights",
    "Precision.last_step_skipped": "Precision.scaler.last_step_skipped",
    "Precision.num_skipped_steps": "Precision.scaler.num_skipped_steps",
    "Precision.scale": "Precision.scaler.get_scale()",
    "Precision.last_grad_norm": "Precision.scaler.last_grad_norm",
    "Precision.identity": "mixprec.precision.identity(precision.policy)",
    "Precision.setup_identity": "mixprec.precision.setup_identity(model)",
    "Precision.forget_setup": "mixprec.precision.forget_setup(model)",
    "Precision.check_optimizer": "Precision.recipe.check_optimizer",
    "Precision.casts_before_sharding": "mixprec.precision.plugins.Fsdp2Plugin(recipe).casts_before_sharding",
    "Precision.fsdp_mixed_precision": "mixprec.precision.plugins.Fsdp2Plugin(recipe).mixed_precision()",
    "Precision.fsdp_island_policy": "mixprec.precision.plugins.Fsdp2Plugin(recipe).island_policy()",
    # no mode change after construction (#38, item 1): the recipe is built with the optimizer
    "Precision.reconcile_with_optimizer": 'mixprec.precision.Precision("auto", optimizer=optimizer)',
}
"""Old ``Class.member`` -> where it went (refused by the class's ``__getattr__``,
:func:`refuse_member`)."""



def _shown(home: str, name: str) -> str:
    """``name``, with its new name where it was renamed in its new home too."""
    renamed = MOVED_NAMES.get(f"{home}.{name}")
    return f"{name} (now {renamed.rpartition('.')[2]})" if renamed else name


def _home(old: str) -> str:
    return MOVED_MODULES.get(old) or MOVED_NAMES.get(old) or MOVED_MEMBERS[old]


def message(old: str) -> str:
    """The one line that refuses ``old`` (a key of :data:`MOVED_MODULES`, :data:`MOVED_NAMES` or
    :data:`MOVED_MEMBERS`)."""
    split = SPLIT.get(old)
    if split is None:
        return f"{old} moved to {_home(old)} in {RELEASE}; see CHANGELOG.md"
    names = [f"{', '.join(_shown(home, name) for name in n) or 'its other names'} -> {home}"
             for home, n in split.items()]
    modules = [f"{m} -> {new}" for m, new in MOVED_MODULES.items() if m.startswith(f"{old}.")]
    return f"{old} was split in {RELEASE}: {'; '.join(names + modules)}; see CHANGELOG.md"


class MovedPathError(ModuleNotFoundError):
    """An import of a path retired in 0.4. ``old`` and ``new`` name both ends; ``name`` is None so
    that ``from package import old_module`` reports this line, not a bare "cannot import name"."""

    def __init__(self, old: str) -> None:
        super().__init__(message(old))
        self.old, self.new = old, _home(old)


class MovedAttributeError(AttributeError):
    """A path retired in 0.4 named as an attribute of its package (``mixprec.fp8``): the line of
    :class:`MovedPathError`, as an ``AttributeError`` so that ``hasattr`` and ``getattr(x, name,
    default)`` work as for any missing name."""

    def __init__(self, old: str) -> None:
        super().__init__(message(old))
        self.old, self.new = old, _home(old)


class MovedFinder(importlib.abc.MetaPathFinder):
    """Refuses the paths of :data:`MOVED_MODULES` and :data:`MOVED_NAMES` (``from mixprec import
    plan_precision`` imports ``mixprec.plan_precision`` once the attribute is missing); every other
    import passes on."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED_MODULES or fullname in MOVED_NAMES:
            raise MovedPathError(fullname)
        return None


def install() -> None:
    """Put one :class:`MovedFinder` first on ``sys.meta_path`` (first: a stale folder left at an
    old path must not import as a namespace package)."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())


def refuse(package: str, name: str):
    """A package's ``__getattr__``: :class:`MovedAttributeError` for a name of :data:`MOVED_NAMES`
    or a module of :data:`MOVED_MODULES` named as an attribute (``mixprec.train.metrics``), a plain
    AttributeError otherwise."""
    old = f"{package}.{name}"
    if old in MOVED_MODULES or old in MOVED_NAMES:
        raise MovedAttributeError(old)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")


def refuse_member(cls: type, name: str):
    """A class's ``__getattr__``: :class:`MovedAttributeError` for a member of
    :data:`MOVED_MEMBERS` (``Precision.keeps_masters``), a plain AttributeError otherwise."""
    old = f"{cls.__name__}.{name}"
    if old in MOVED_MEMBERS:
        raise MovedAttributeError(old)
    raise AttributeError(f"{cls.__name__!r} object has no attribute {name!r}")
