"""Which formats a layer must not take, whatever its estimated loss change: the sensitivity gates.

A one-forward loss estimate sees only the forward error's effect on the loss. Training also runs
on the gradients each layer sends down (input gradient) and steps on (weight gradient), and an
outlier channel can wipe out the rest of a tensor while its SQNR still looks tolerable. The gates
read the planner's other measurements (:class:`mixprec.plan.plan.LayerMeasure`) and refuse a
format for a layer when one of them says it breaks; the estimate then ranks what is left.

Each format is judged by its own limits (:mod:`mixprec.formats.limits`: NVFP4's healthy layers
measure 16.5 dB where FP8's measure 28.5), the same the training guard and the what-if apply, and
the output-SQNR test is one function for all three (:func:`output_refusal`).
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from mixprec.formats.limits import format_limits

LayerMeasure = Any
"""A :class:`mixprec.plan.plan.LayerMeasure` (not imported: ``plan`` imports these limits)."""

__all__ = ["gate", "apply_gates", "stands_out", "output_refusal", "MIN_SQNR_DB", "MAX_FLUSH",
           "MAX_SQNR_DROP_DB", "SAFE_SQNR_DB"]

MIN_SQNR_DB = format_limits("fp8-tensorwise").min_grad_sqnr_db
"""FP8's gradient-SQNR limit (15 dB), kept for old imports: the gates read each format's own
limits (:func:`mixprec.formats.limits.format_limits`; ``min_sqnr_db=None``)."""
MAX_FLUSH = format_limits("fp8-tensorwise").max_flush
"""FP8's flushed-share limit (1 %), kept for old imports (as :data:`MIN_SQNR_DB`)."""
MAX_SQNR_DROP_DB = 4.0
"""A format whose *output* SQNR is this much below the median of the other layers' in the same
format is refused (measured: 4.8-5.8 dB for the outlier layer of ``tests/plan/test_planner.py``,
at most 1.5 dB for the other layers)."""
SAFE_SQNR_DB = 40.0
"""An SQNR above this (noise below 0.01 % of the signal's power, BF16 territory), or above the
format's healthy SQNR (:mod:`mixprec.formats.limits`: 28.5 dB in FP8, 16.5 in NVFP4), is never
refused for being below the other layers': layer kinds differ (an MLP's second Linear, reading
GELU outputs, measures 8-9 dB above its first in FP8 and NVFP4 alike), and a layer at the format's
healthy level is no outlier."""


def stands_out(sqnr_db: float, peers: Sequence[float], *, min_sqnr_db: float,
               max_sqnr_drop_db: float = MAX_SQNR_DROP_DB,
               safe_sqnr_db: float = SAFE_SQNR_DB) -> tuple[str, float] | None:
    """(why, severity) when an SQNR is too low, else None: below ``min_sqnr_db``, or more than
    ``max_sqnr_drop_db`` below the median of ``peers`` (other layers in the same format) while
    under ``safe_sqnr_db``. Severity: the noise power over the limit's (> 1). With a format's
    limits: :func:`output_refusal`."""
    if sqnr_db < min_sqnr_db:
        return f"SQNR {sqnr_db:.1f} dB < {min_sqnr_db:g}", 10 ** ((min_sqnr_db - sqnr_db) / 10)
    finite = [p for p in peers if p == p]
    if finite and sqnr_db < safe_sqnr_db:
        limit = statistics.median(finite) - max_sqnr_drop_db
        if sqnr_db < limit:
            return (f"SQNR {sqnr_db:.1f} dB, {limit + max_sqnr_drop_db - sqnr_db:.1f} dB below the "
                    "other layers' median"), 10 ** ((limit - sqnr_db) / 10)
    return None


def output_refusal(sqnr_db: float, fmt: str, peers: Sequence[float] = (), *,
                   min_sqnr_db: float | None = None,
                   max_sqnr_drop_db: float = MAX_SQNR_DROP_DB) -> tuple[str, float] | None:
    """(why, severity) when a layer's output SQNR in ``fmt`` fails: below the format's limit
    (:func:`~mixprec.formats.limits.format_limits`; a given ``min_sqnr_db`` replaces it), or, with two or more ``peers``
    (the other layers' output SQNRs in ``fmt``), ``max_sqnr_drop_db`` below their median while
    under the format's healthy SQNR (and :data:`SAFE_SQNR_DB`). The planner's gates, the guard's
    samples and spike culprit, and the what-if's safe verdict all ask this."""
    limits = format_limits(fmt, min_sqnr_db=min_sqnr_db)
    return stands_out(sqnr_db, peers if len(peers) >= 2 else (), min_sqnr_db=limits.min_sqnr_db,
                      max_sqnr_drop_db=max_sqnr_drop_db,
                      safe_sqnr_db=min(limits.healthy_sqnr_db, SAFE_SQNR_DB))


def gate(m: LayerMeasure, fmt: str, *, min_sqnr_db: float | None = None,
         max_flush: float | None = None, max_sqnr_drop_db: float = MAX_SQNR_DROP_DB,
         peers: Sequence[float] = ()) -> tuple[str, float] | None:
    """(why, severity) when ``fmt`` is too risky for layer ``m`` whatever its estimated loss
    change, else None. The limits are ``fmt``'s own (:func:`~mixprec.formats.limits.format_limits`; a given ``min_sqnr_db``
    / ``max_flush`` replaces them). Refused: an output SQNR below the format's limit, or an input-
    or weight-gradient SQNR below its gradient limit; an *output* SQNR more than
    ``max_sqnr_drop_db`` below ``peers`` (the other layers' output SQNRs in ``fmt``: a layer the
    format treats worse than the rest, as outliers do; gradient SQNRs differ between layer kinds
    too much for that; :func:`output_refusal`); more than the format's flushed share of its inputs or output gradients flushed or saturated (outliers dominate a tensor's energy, so
    its SQNR can stay high while the rest of it is lost). Severity: how far over its worst limit
    (noise power over the limit's, flushed share over the limit), for the ranking."""
    limits = format_limits(fmt, min_sqnr_db=min_sqnr_db, max_flush=max_flush)
    found: list[tuple[str, float]] = []
    for label, d in (("output", m.sqnr_out), ("input-gradient", m.sqnr_dgrad), ("weight-gradient", m.sqnr_grad)):
        v = d.get(fmt)
        if v is None or v != v:                            # not measured (NaN)
            continue
        if label == "output":
            bad = output_refusal(v, fmt, peers, min_sqnr_db=min_sqnr_db,
                                 max_sqnr_drop_db=max_sqnr_drop_db)
        else:
            bad = stands_out(v, (), min_sqnr_db=limits.min_grad_sqnr_db)
        if bad:
            found.append((f"{label} {bad[0]}", bad[1]))
    for label, d in (("inputs", m.flush_in), ("output gradients", m.flush_grad)):
        v = d.get(fmt)
        if v is not None and v > limits.max_flush:
            found.append((f"{100 * v:.1f}% of its {label} flushed or saturated > "
                          f"{100 * limits.max_flush:.3g}%", v / max(limits.max_flush, 1e-12)))
    if not found:
        return None
    return "; ".join(w for w, _ in found), max(sev for _, sev in found)


def apply_gates(layers: Sequence[LayerMeasure], fmts: Sequence[str], *,
                min_sqnr_db: float | None = None, max_flush: float | None = None,
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
