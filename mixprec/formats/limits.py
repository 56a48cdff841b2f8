"""How good a healthy layer looks in each format, and the limits the guard, planner and what-if apply.

A Linear's output in a narrow format has a noise floor set by the format itself: FP8 E4M3 gives
about 28.5 dB of output SQNR against FP32 on ordinary inputs, NVFP4 about 16.5 dB. A limit that is
right for one format is wrong for the next: FP8's 20 dB refuses every NVFP4 layer, healthy or not.
So each format has its own yardstick, here and only here:

* **healthy SQNR**: the output SQNR (dB, against the same GEMM in FP32) of one 256 -> 256 Linear
  with N(0, 1/256) weights on Gaussian inputs, quantized as the format's layer quantizes
  (``benchmarks/format_limits.py``; the same measurement as the guard's sample). Heavy-tailed
  (Student-t 3 and 5), GELU and SiLU-gated inputs move it by at most 1.2 dB; layers of mixprec's
  ``tiny``/``small`` Transformers and of a tiny Hugging Face Llama, trained 30 steps, measured at
  or above it minus 0.7 dB (docs/per-layer.md has the tables).
* **healthy flushed share**: the share of a layer's input the format flushes to zero or saturates
  (:func:`mixprec.monitor.replan.flushed_share`), the largest over those synthetic inputs and the
  trained models' layers. In a 4-bit format it is large on healthy layers (a value below 1/24 of
  its block's largest flushes: SiLU-gated inputs, with most values near zero, lose 27 % in
  NVFP4), which is why one flushed-share limit cannot serve every format.

The limits are a stated margin from the healthy figures:

* ``min_sqnr_db`` = healthy SQNR - :data:`SQNR_MARGIN_DB` (8.5 dB: noise power 7 times the
  healthy layer's), never above :data:`SQNR_CAP_DB` (20 dB, noise 1 % of the signal: BF16 and
  FP16 layers are held to FP8's bar, not to their own 50-69 dB). FP8: 20 dB, as before.
* ``max_flush`` = :data:`FLUSH_MARGIN` (1.5) times the healthy flushed share, never below
  :data:`FLUSH_FLOOR` (1 %). FP8: 1 %, as before.
* the planner's gradient SQNRs (input and weight gradient) get :data:`GRAD_ALLOWANCE_DB` (5 dB)
  less: gradients are quantized in E5M2 or with stochastic rounding and sit that much lower on
  healthy layers (FP8 tensorwise: 24.5 dB input gradient against 28.7 output). FP8: 15 dB, as before.

An outlier layer (a few input channels 10^4 times the rest, ``tests/guard_nets.py``) measures
0.7-4.5 dB and 41-97 % flushed in MXFP4/NVFP4 and fails; the same model's other layers pass.

A user's own limit (``guard_min_sqnr=``, ``min_sqnr_db=``, ``max_flush=``, ...) replaces the
per-format one for every format, applied as given (:func:`format_limits`).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FormatLimits", "format_limits", "HEALTHY", "SQNR_MARGIN_DB", "SQNR_CAP_DB",
           "FLUSH_MARGIN", "FLUSH_FLOOR", "GRAD_ALLOWANCE_DB"]

SQNR_MARGIN_DB = 8.5
"""How far below a format's healthy output SQNR the limit sits (dB)."""
SQNR_CAP_DB = 20.0
"""No format's SQNR limit is above this (dB): noise 1 % of the signal's power."""
FLUSH_MARGIN = 1.5
"""The flushed-share limit is this many times the format's healthy flushed share ..."""
FLUSH_FLOOR = 0.01
"""... and never below this."""
GRAD_ALLOWANCE_DB = 5.0
"""The planner's gradient SQNR limit is this much below the output one (dB)."""

HEALTHY: dict[str, tuple[float, float]] = {
    # format: (healthy output SQNR dB, healthy flushed share), benchmarks/format_limits.py
    # (2026-12-01, AVX2 CPU): Gaussian SQNR rounded down to 0.5 dB; flushed share the largest of
    # the synthetic inputs and the trained models' layers, rounded up (to 0.05 % below 1 %, to 1 % above).
    "fp8-tensorwise": (28.5, 0.0005),
    "fp8-delayed": (28.5, 0.0005),
    "fp8-rowwise": (28.5, 0.0005),
    "fp8-blockwise": (28.5, 0.0005),
    "mxfp8": (27.5, 0.014),
    "mxfp4": (15.5, 0.37),
    "nvfp4": (16.5, 0.28),
    "bf16": (50.5, 0.0),
    "fp16": (68.5, 0.0),
}
"""Per format: what a healthy layer measures (module docstring)."""


@dataclass(frozen=True, kw_only=True)
class FormatLimits:
    """The limits a layer in ``format`` must keep (module docstring)."""

    format: str
    healthy_sqnr_db: float
    """What a healthy layer measures in this format (:data:`HEALTHY`): at or above it, a layer is
    no outlier however far it sits below other layers (the planner's peer check)."""
    healthy_flush: float
    min_sqnr_db: float
    """Output SQNR (dB, against FP32) below which the layer is refused / promoted."""
    max_flush: float
    """Share of its inputs (and, for the planner, output gradients) flushed or saturated above
    which it is refused / promoted."""
    min_grad_sqnr_db: float
    """The planner's limit on input- and weight-gradient SQNRs."""
    given: bool = False
    """Whether a user's limit replaced the per-format one."""

    def describe(self) -> str:
        """``"< 8 dB or > 40.5 % flushed"``: the limits in a line's words."""
        return f"< {self.min_sqnr_db:g} dB or > {100 * self.max_flush:.3g} % flushed"


def format_limits(fmt: str, *, min_sqnr_db: float | None = None,
                  max_flush: float | None = None) -> FormatLimits:
    """The limits of layer format ``fmt``; a given ``min_sqnr_db`` / ``max_flush`` replaces the
    per-format value as given (the gradient limit then follows it, :data:`GRAD_ALLOWANCE_DB`
    lower). A format without a healthy figure (``fp32``) is held to FP8's."""
    sqnr, flush = HEALTHY.get(fmt, HEALTHY["fp8-tensorwise"])
    own_sqnr = min(sqnr - SQNR_MARGIN_DB, SQNR_CAP_DB)
    own_flush = max(FLUSH_MARGIN * flush, FLUSH_FLOOR)
    out = own_sqnr if min_sqnr_db is None else float(min_sqnr_db)
    return FormatLimits(format=fmt, healthy_sqnr_db=sqnr, healthy_flush=flush, min_sqnr_db=out,
                        max_flush=own_flush if max_flush is None else float(max_flush),
                        min_grad_sqnr_db=out - GRAD_ALLOWANCE_DB,
                        given=min_sqnr_db is not None or max_flush is not None)
