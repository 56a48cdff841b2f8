"""The FP8 operands of one layer's three GEMMs, by recipe: which casts, along which dimension,
and which of them are free transposes of another.

For ``y = x W^T`` the operands are cast along each GEMM's contraction dimension. A tensor that
feeds two GEMMs along different dimensions (x: K for the forward, tokens for the weight gradient;
W: K, then N; dy: N, then tokens) is cast once per dimension its recipe needs, *together* (one
:func:`~mixprec.formats.fp8_cast.cast_group` call: the scale math is shared, the non-finite flag
updated once). One scale per tensor, and square 128x128 weight blocks, make the second operand the
transpose of the first: no second cast. Everything here takes plain values (a frozen
:class:`Recipe`, tensors), so ``torch.compile`` traces it.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from mixprec.errors import NumericsError
from mixprec.formats import fp8_cast
from mixprec.formats.fp8_config import Fp8Config
from mixprec.formats.fp8_path import GemmPlan
from mixprec.formats.fp8_quantize import Block, Fp8Tensor

__all__ = ["Recipe", "cast_operands", "compiled_casts", "CompiledCasts", "operand_block",
           "raise_if_nonfinite"]

_SLOTS = {"x": 0, "w": 1, "g": 2}  # rows of the delayed-scaling amax history


def operand_block(config: Fp8Config, kind: str) -> Block:
    """Scale granularity of a GEMM operand laid out (rows, contraction)."""
    if config.scaling in ("tensorwise", "delayed"):
        return None
    if config.scaling == "rowwise":
        return (1, None)
    return config.weight_block if kind == "weight" else config.activation_block


@dataclass(frozen=True)
class Recipe:
    """What the autograd function needs of a layer, as plain values (no module: compile-friendly)."""

    config: Fp8Config
    plan: GemmPlan
    owner: str
    cast: Callable[..., list[tuple[torch.Tensor, torch.Tensor]]]
    """:func:`~mixprec.formats.fp8_cast.cast_group` or its ``torch.compile``d twin (decided with
    the plan)."""


_GRAN = {"tensorwise": "tensor", "delayed": "tensor", "rowwise": "row"}


def _spec(cfg: Fp8Config, role: str, dim: int) -> tuple[str, int, tuple[int, int]]:
    """The cast spec (granularity, dim, block) of an operand of ``role`` along ``dim``."""
    if cfg.scaling in _GRAN:
        return _GRAN[cfg.scaling], dim, (1, 1)
    if role == "weight":
        return "block", dim, cfg.weight_block
    return "tile", dim, cfg.activation_block


class CompiledCasts:
    """:func:`~mixprec.formats.fp8_cast.cast_group` through ``torch.compile`` (CUDA with Triton):
    one fused kernel per operand instead of a chain of eager ops.

    Each static configuration (specs, FP8 dtype, input dtypes, ...) gets its own copy of the
    function's code: dynamo's recompile limit (8) counts per code object, and a model mixing
    recipes and dtypes has more configurations than that. Each copy then recompiles only when
    shapes change (once, to a dynamic-shape graph). No ``fullgraph``: past a limit a copy runs
    eagerly with dynamo's warning rather than failing a training step; that the function traces
    as one graph is tested on the CPU (tests/formats/test_fp8_cost.py)."""

    def __init__(self) -> None:
        self._fns: dict[tuple, Callable[..., Any]] = {}

    def __call__(self, tensors, specs, fp8_dtype, **kw):
        if torch.compiler.is_compiling():      # inside the user's compiled model: inline, fused there
            return fp8_cast.cast_group(tensors, specs, fp8_dtype, **kw)
        key = (specs, fp8_dtype, tuple(t.dtype for t in tensors), kw.get("margin"),
               kw.get("power_of_two"), kw.get("flag") is not None, kw.get("flag_from"))
        fn = self._fns.get(key)
        if fn is None:
            src = fp8_cast.cast_group
            name = f"{src.__name__}_{len(self._fns)}"
            copy = types.FunctionType(src.__code__.replace(co_name=name), src.__globals__, name,
                                      src.__defaults__, src.__closure__)
            copy.__kwdefaults__ = src.__kwdefaults__
            fn = self._fns[key] = torch.compile(copy, dynamic=None)
        return fn(tensors, specs, fp8_dtype, **kw)


_COMPILED: CompiledCasts | None = None


def compiled_casts() -> CompiledCasts:
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = CompiledCasts()
    return _COMPILED


def _as_operand(data: torch.Tensor, scale: torch.Tensor, spec: tuple[str, int, tuple[int, int]]) -> Fp8Tensor:
    """The GEMM operand (rows, contraction) from a cast along ``dim`` (dim 0: the transpose)."""
    gran, dim, block = spec
    if gran == "tensor":
        q = Fp8Tensor(data, scale, None)
        return q if dim == 1 else q.t()
    if gran == "row":
        return Fp8Tensor(data, scale, (1, data.shape[1])) if dim == 1 else \
            Fp8Tensor(data.t(), scale.t(), (1, data.shape[0]))
    if gran == "block":
        q = Fp8Tensor(data, scale, block)
        return q if dim == 1 else q.t()
    return Fp8Tensor(data, scale, block) if dim == 1 else Fp8Tensor(data.t(), scale.t(), block)


def cast_operands(rec: Recipe, t: torch.Tensor, role: str, dims: tuple[int, ...],
                  flag: torch.Tensor | None, hist: torch.Tensor | None, slot: str,
                  update_history: bool) -> list[Fp8Tensor]:
    """The operands of ``t`` for each contraction dim in ``dims`` (1: ``t`` is the operand; 0:
    ``t.t()`` is), cast together. ``role`` is ``act``, ``weight`` or ``grad``.

    Delayed scaling casts each orientation on its own: the first records the current amax in the
    history (``update_history``), the next ones read the history it left, as the recipe's scale
    is defined (so a transpose is not the first cast's bytes)."""
    cfg = rec.config
    fp8_dtype = cfg.grad_dtype if role == "grad" else cfg.forward_dtype
    specs = tuple(_spec(cfg, role, d) for d in dims)
    if cfg.scaling == "delayed":
        out = []
        for i, sp in enumerate(specs):
            data, scale = _delayed_cast(t, fp8_dtype, cfg, flag, hist[_SLOTS[slot]],
                                        update_history and i == 0)
            out.append(_as_operand(data, scale, sp))
        return out
    if cfg.scaling == "tensorwise" or (cfg.scaling == "blockwise" and role == "weight"):
        # one scale, or square blocks: every orientation is the transpose of one cast
        data, scale = rec.cast([t], specs[:1], fp8_dtype, margin=cfg.margin,
                               power_of_two=cfg.power_of_two_scales, flag=flag, flag_from=(0,))[0]
        first = _as_operand(data, scale, specs[0])
        return [first if sp == specs[0] else first.t() for sp in specs]
    casts = rec.cast([t] * len(specs), specs, fp8_dtype, margin=cfg.margin,
                     power_of_two=cfg.power_of_two_scales, flag=flag, flag_from=(0,))
    return [_as_operand(d, s, sp) for (d, s), sp in zip(casts, specs)]


def _delayed_cast(t: torch.Tensor, fp8_dtype: torch.dtype, cfg: Fp8Config, flag: torch.Tensor | None,
                  hist: torch.Tensor, update: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensorwise cast from the amax history (first call: the current amax), then record the
    current amax (non-finite values recorded as 0, so one bad step does not poison the history)."""
    cur = fp8_cast.tensor_amax(t)
    past = hist.max() if cfg.amax_compute == "max" else hist[0]
    amax = torch.where(past > 0, past, cur.reshape(()))
    out = fp8_cast.cast_with_amax(t, fp8_dtype, amax, margin=cfg.margin,
                                  power_of_two=cfg.power_of_two_scales, own_amax=cur, flag=flag)
    if update:
        hist.copy_(torch.roll(hist, 1))
        hist[0] = torch.nan_to_num(cur.reshape(()), nan=0.0, posinf=0.0)
    return out


def raise_if_nonfinite(rec: Recipe, fqn: str, named: list[tuple[str, Fp8Tensor]]) -> None:
    """``nonfinite="raise"``: one host read for all of this call's operands, naming the first bad one."""
    bad = torch.stack([q.nonfinite for _, q in named]).tolist()
    for (what, q), b in zip(named, bad):
        if b:
            raise NumericsError(f"{rec.owner} '{fqn or '<unnamed>'}' {what} of shape "
                                f"{tuple(q.shape)} contains inf or NaN before FP8 quantization; "
                                "find the producing layer with mixprec.monitor, or lower the "
                                "learning rate / loss scale")
