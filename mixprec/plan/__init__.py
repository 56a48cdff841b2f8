"""Per-layer precision planning (a tool): measure each Linear's sensitivity and cost, choose its
format (``mixprec plan``, :func:`plan_precision`), and the what-if report of every format per layer
(``mixprec whatif``, :func:`what_if`). Re-planning while training and the guard belong to the
training loop: :mod:`mixprec.monitor` (``LayerReplanner``, ``TrainingGuard``)."""
from mixprec import _moved
from mixprec.plan.plan import LayerMeasure, PrecisionPlan, format_throughput
from mixprec.plan.planner import DEFAULT_CANDIDATES, plan_precision
from mixprec.plan.whatif import WHATIF_FORMATS, WhatIfReport, what_if

__all__ = ["plan_precision", "PrecisionPlan", "LayerMeasure", "DEFAULT_CANDIDATES", "format_throughput",
           "what_if", "WhatIfReport", "WHATIF_FORMATS"]


def __getattr__(name: str):
    _moved.refuse(__name__, name)     # re-planning and the guard moved to mixprec.monitor in 0.4
