"""Per-layer precision planning: measure each Linear's sensitivity and cost, choose its format
(``mixprec plan``, :func:`plan_precision`), the what-if report of every format per layer
(``mixprec whatif``, :func:`what_if`), re-plan formats while training (:class:`LayerReplanner`),
and guard training (:class:`TrainingGuard`: a layer that goes bad moves to a safer format)."""
from mixprec.plan.guard import GuardConfig, TrainingGuard
from mixprec.plan.plan import LayerMeasure, PrecisionPlan, format_throughput
from mixprec.plan.planner import DEFAULT_CANDIDATES, plan_precision
from mixprec.plan.replan import FormatSwitch, LayerReplanner
from mixprec.plan.whatif import WHATIF_FORMATS, WhatIfReport, what_if

__all__ = ["plan_precision", "PrecisionPlan", "LayerMeasure", "DEFAULT_CANDIDATES", "format_throughput",
           "LayerReplanner", "FormatSwitch", "TrainingGuard", "GuardConfig", "what_if", "WhatIfReport",
           "WHATIF_FORMATS"]
