"""Which formats a layer must not take, whatever its estimated loss change: the sensitivity gates.

A one-forward loss estimate sees only the forward error's effect on the loss. Training also runs
on the gradients each layer sends down (input gradient) and steps on (weight gradient), and an
outlier channel can wipe out the rest of a tensor while its SQNR still looks tolerable. The gates
read the planner's other measurements (:class:`mixprec.plan.plan.LayerMeasure`) and refuse a
format for a layer when one of them says it breaks; the estimate then ranks what is left.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

LayerMeasure = Any
"""A :class:`mixprec.plan.plan.LayerMeasure` (not imported: ``plan`` imports these limits)."""

__all__ = ["gate", "apply_gates", "stands_out", "MIN_SQNR_DB", "MAX_FLUSH", "MAX_SQNR_DROP_DB", "SAFE_SQNR_DB"]

MIN_SQNR_DB = 15.0
"""A format whose output, input-gradient or weight-gradient SQNR against FP32 is below this is
refused for the layer (FP8 E4M3 gives about 30 dB on well-scaled tensors, BF16 about 50)."""
MAX_FLUSH = 0.01
"""... and so is one that flushes or saturates more than this share of the layer's inputs or
output gradients (the re-planner's limit, :class:`mixprec.plan.replan.LayerReplanner`)."""
MAX_SQNR_DROP_DB = 4.0
"""... and so is one whose *output* SQNR is this much below the median of the other layers' in
the same format (measured: 4.8-5.8 dB for the outlier layer of ``tests/plan/test_planner.py``, at
most 1.5 dB for the other layers)."""
SAFE_SQNR_DB = 40.0
"""An SQNR above this (noise below 0.01 % of the signal's power, BF16 territory) is never refused
for being below the other layers'."""


def stands_out(sqnr_db: float, peers: Sequence[float], *, min_sqnr_db: float = MIN_SQNR_DB,
               max_sqnr_drop_db: float = MAX_SQNR_DROP_DB) -> tuple[str, float] | None:
    """(why, severity) when an SQNR is too low, else None: below ``min_sqnr_db``, or more than
    ``max_sqnr_drop_db`` below the median of ``peers`` (other layers in the same format) while
    under :data:`SAFE_SQNR_DB`. Severity: the noise power over the limit's (> 1). The planner's
    gates and the training guard's spike culprit use it."""
    if sqnr_db < min_sqnr_db:
        return f"SQNR {sqnr_db:.1f} dB < {min_sqnr_db:g}", 10 ** ((min_sqnr_db - sqnr_db) / 10)
    finite = [p for p in peers if p == p]
    if finite and sqnr_db < SAFE_SQNR_DB:
        limit = statistics.median(finite) - max_sqnr_drop_db
        if sqnr_db < limit:
            return (f"SQNR {sqnr_db:.1f} dB, {limit + max_sqnr_drop_db - sqnr_db:.1f} dB below the "
                    "other layers' median"), 10 ** ((limit - sqnr_db) / 10)
    return None


def gate(m: LayerMeasure, fmt: str, *, min_sqnr_db: float = MIN_SQNR_DB,
         max_flush: float = MAX_FLUSH, max_sqnr_drop_db: float = MAX_SQNR_DROP_DB,
         peers: Sequence[float] = ()) -> tuple[str, float] | None:
    """(why, severity) when ``fmt`` is too risky for layer ``m`` whatever its estimated loss
    change, else None. Refused: an SQNR (output, input gradient, weight gradient) below
    ``min_sqnr_db``; an *output* SQNR more than ``max_sqnr_drop_db`` below ``peers`` (the other
    layers' output SQNRs in ``fmt``: a layer the format treats worse than the rest, as outliers
    do; gradient SQNRs differ between layer kinds too much for that); more than ``max_flush`` of
    its inputs or output gradients flushed or saturated (outliers dominate a tensor's energy, so
    its SQNR can stay high while the rest of it is lost). Severity: how far over its worst limit
    (noise power over the limit's, flushed share over ``max_flush``), for the ranking."""
    found: list[tuple[str, float]] = []
    for label, d in (("output", m.sqnr_out), ("input-gradient", m.sqnr_dgrad), ("weight-gradient", m.sqnr_grad)):
        v = d.get(fmt)
        if v is None or v != v:                            # not measured (NaN)
            continue
        bad = stands_out(v, peers if label == "output" else (), min_sqnr_db=min_sqnr_db,
                         max_sqnr_drop_db=max_sqnr_drop_db)
        if bad:
            found.append((f"{label} {bad[0]}", bad[1]))
    for label, d in (("inputs", m.flush_in), ("output gradients", m.flush_grad)):
        v = d.get(fmt)
        if v is not None and v > max_flush:
            found.append((f"{100 * v:.1f}% of its {label} flushed or saturated > {100 * max_flush:g}%",
                          v / max_flush))
    if not found:
        return None
    return "; ".join(w for w, _ in found), max(sev for _, sev in found)


def apply_gates(layers: Sequence[LayerMeasure], fmts: Sequence[str], *,
                min_sqnr_db: float = MIN_SQNR_DB, max_flush: float = MAX_FLUSH,
                max_sqnr_drop_db: float = MAX_SQNR_DROP_DB) -> None:
    """Set every layer's ``risky`` formats and their ``severity`` (:func:`gate`; peers: the other
    layers measured in the same format)."""
    for f in fmts:
        if f == "fp32":
            continue
        measured = [m for m in layers if f in m.sqnr_out]
        for m in measured:
            peers = [o.sqnr_out[f] for o in measured if o is not m]
            bad = gate(m, f, min_sqnr_db=min_sqnr_db, max_flush=max_flush,
                       max_sqnr_drop_db=max_sqnr_drop_db, peers=peers if len(peers) >= 2 else ())
            if bad:
                m.risky[f], m.severity[f] = bad
            else:
                m.risky.pop(f, None)
                m.severity.pop(f, None)
