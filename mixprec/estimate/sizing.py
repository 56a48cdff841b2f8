"""A model shape of a given parameter count (``mixprec memory --params 7B``).

A preset's own width is a toy's (``small``: d=128): reaching 7B by stacking its blocks gives
35,305 layers of width 128, whose activations (layers x width per token) are 34 times a real 7B's.
So unless a width is asked for (``--d-model``, or ``--model M``: that model, deeper or shallower),
width and depth grow together, at GPT-3's aspect ratio (Brown et al. 2020, table 2.1: d_model =
128 x layers from 6.7B up, 128-wide heads): 7B is 33 layers of 4,224.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from mixprec.errors import ConfigError
from mixprec.estimate.memory import ModelShape

__all__ = ["shape_for_params", "HEAD_DIM"]

HEAD_DIM = 128
"""Head width of a shape sized by :func:`shape_for_params` (GPT-3's, Llama's)."""


def _closest(make: Callable[[int], ModelShape], target: float) -> ModelShape:
    """``make(k)`` for the ``k >= 1`` whose parameter count is nearest ``target`` (counts grow with k)."""
    hi = 1
    while make(hi).num_parameters() < target:
        hi *= 2
    lo = max(1, hi // 2)
    while lo < hi:                                   # the first k whose count reaches the target
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if make(mid).num_parameters() < target else (lo, mid)
    return min((make(k) for k in {max(1, lo - 1), lo}), key=lambda s: abs(s.num_parameters() - target))


def shape_for_params(shape: ModelShape, params: float, *, layers: int | None = None,
                     d_model: int | None = None, keep_width: bool = False) -> ModelShape:
    """``shape`` resized to about ``params`` parameters.

    ``d_model`` given (or ``keep_width``: the shape's own): the depth is solved. ``layers`` given:
    the width (a multiple of :data:`HEAD_DIM`, one head per 128). Neither: both, ``d_model = 128 *
    layers``. Everything else (vocabulary, MLP ratio, experts, tied embeddings) stays the shape's.
    """
    if params <= 0:
        raise ConfigError(f"--params must be > 0, got {params:g}")
    if layers is not None and d_model is not None:
        raise ConfigError("--params with both --layers and --d-model: give at most one of them "
                          "(--params sizes the other)")
    if d_model is not None or (layers is None and keep_width):
        width = d_model if d_model is not None else shape.d_model
        base = dataclasses.replace(shape, d_model=width)
        return _closest(lambda n: dataclasses.replace(base, num_layers=n), params)
    if layers is not None:
        return _closest(lambda h: dataclasses.replace(shape, num_layers=layers, d_model=HEAD_DIM * h,
                                                      num_heads=h), params)
    return _closest(lambda n: dataclasses.replace(shape, num_layers=n, d_model=HEAD_DIM * n, num_heads=n),
                    params)
