"""Per-layer precision planning: measure each Linear's sensitivity and cost, choose its format
(``mixprec plan``, :func:`plan_precision`)."""
from mixprec.plan.planner import DEFAULT_CANDIDATES, LayerMeasure, PrecisionPlan, format_throughput, plan_precision

__all__ = ["plan_precision", "PrecisionPlan", "LayerMeasure", "DEFAULT_CANDIDATES", "format_throughput"]
