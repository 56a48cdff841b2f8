"""Numerics monitoring: trace NaN/Inf to the layer that made it, per-layer range statistics,
a pre-flight precision audit and a stuck-loss-scale watch."""
from mixprec.monitor.audit import Finding, audit, audit_after_first_step, format_findings
from mixprec.monitor.stats import NUMERICS_COLUMNS, NumericsMonitor, NumericsRow, Sample, range_counts, ulp
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
]


def __getattr__(name: str):
    # ``mixprec.monitor.LayerReplanner``: an old import path; re-planning lives in mixprec.plan.
    if name in ("LayerReplanner", "FormatSwitch"):
        from mixprec.plan import replan
        return getattr(replan, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
