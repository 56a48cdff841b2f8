"""Numerics monitoring while training: trace NaN/Inf to the layer that made it, per-layer range
statistics, a pre-flight precision audit, a stuck-loss-scale watch, and acting on what it sees:
re-planning per-layer formats (:class:`LayerReplanner`) and guarded training (:class:`TrainingGuard`:
a layer that goes bad moves to a safer format). The planner and the what-if report (tools) live in
:mod:`mixprec.plan`."""
from mixprec.monitor.audit import Finding, audit, audit_after_first_step, format_findings
from mixprec.monitor.stats import NUMERICS_COLUMNS, NumericsMonitor, NumericsRow, Sample, range_counts, ulp
from mixprec.monitor.guard import GuardConfig, TrainingGuard
from mixprec.monitor.replan import FormatSwitch, LayerReplanner
from mixprec.monitor.stuck import ScaleWatch, StuckScaleWarning
from mixprec.monitor.trace import (NonFiniteEvent, RngState, capture_rng_state, locate_nonfinite,
                                   replay_rng_state)

__all__ = [
    # non-finite tracing
    "locate_nonfinite", "NonFiniteEvent", "capture_rng_state", "replay_rng_state", "RngState",
    # per-layer statistics
    "NumericsMonitor", "NumericsRow", "Sample", "NUMERICS_COLUMNS", "range_counts", "ulp",
    # pre-flight audit
    "audit", "audit_after_first_step", "Finding", "format_findings",
    # stuck loss scale
    "ScaleWatch", "StuckScaleWarning",
    # acting on it: formats re-planned while training, the guard
    "LayerReplanner", "FormatSwitch", "TrainingGuard", "GuardConfig",
]

