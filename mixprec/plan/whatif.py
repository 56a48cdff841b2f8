"""``what_if``: which format can each Linear layer take, before renting the hardware?

For a model and a few batches, one FP32 forward and backward records each Linear's input, output
and output gradient (the planner's reference pass, :mod:`mixprec.plan.planner`). Then for every
format ``f`` (FP8 tensorwise / rowwise / blockwise, MXFP8, MXFP4, NVFP4, BF16) each layer ``L``
is built as training would build it (:class:`mixprec.Precision` with the override ``* = f``, so
the same modules and the same eligibility rules), and with *only* ``L`` in ``f``:

* output SQNR: ``L_f(x)`` against ``L``'s FP32 output on the recorded inputs (dB);
* gradient SQNR: ``L_f``'s weight gradient from the recorded FP32 output gradients (dB);
* underflow: share of the non-zero elements of the forward operands (input, weight) and of the
  output gradient that quantize to zero; saturation: share whose scaled magnitude lies beyond the
  element format's largest value plus half its last step (the clamp changed them; with amax
  scaling this happens only where a power-of-two or E4M3 scale rounds down: MX and NVFP4);
* loss change: the model's forward loss with ``L`` alone in ``f``, ``mean |loss_f - loss| /
  loss`` over the batches (measured, not estimated; the blocks before ``L`` and ``L`` itself are
  replayed from what was already computed, :class:`mixprec.plan.measure.Replay`, bit-identical);
* projected GEMM speed-up on a GPU: the format's dense datasheet peak over BF16's
  (:data:`mixprec.estimate.gpus.GPUS`; 1.0 where the rules keep the layer out of the format).

A cell is *safe* when its loss change is at most ``tolerance`` (a fraction of the loss), its
results are finite, and it keeps the format's limits: output SQNR, weight-gradient SQNR and the
share of its inputs flushed or saturated (:mod:`mixprec.formats.limits`; the training guard and
the planner's gates apply the same limits, so a layer the what-if calls safe is not promoted by
``guard=true`` at its first sample, nor refused by ``mixprec plan``). Each layer's choice is its
safe format with the largest projected speed-up (ties: the higher output SQNR); no safe format at all: ``fp32``. The choice is then measured
as a whole: every layer in its chosen format at once, loss change against FP32 as above.

Works on anything :func:`mixprec.fit` trains: mixprec's Transformer, a Hugging Face causal LM,
or a user's ``nn.Module`` with ``loss_fn``. Numerics are emulated on a CPU (real FP8 GEMMs on an
FP8 GPU), so the answer does not need the target hardware; the speed-ups are the datasheet's.
"""
from __future__ import annotations

import csv
import textwrap
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.precision import Precision
from mixprec.errors import ConfigError
from mixprec.formats import sqnr_db
from mixprec.formats.limits import format_limits
from mixprec.monitor.gates import output_refusal
from mixprec.plan.grid import GridRow, format_counts, layer_grid
from mixprec.plan.measure import (Call, Replay, block_list, format_variants, layer_alone,
                                  linear_names, losses_with, planned_layers, reference_pass)
from mixprec.plan.verify import fp32_copy
from mixprec.policy.overrides import is_micro, parse_format

__all__ = ["what_if", "WhatIfReport", "WhatIfRow", "FormatCell", "WHATIF_FORMATS"]

WHATIF_FORMATS: tuple[str, ...] = ("fp8-tensorwise", "fp8-rowwise", "fp8-blockwise", "mxfp8",
                                   "mxfp4", "nvfp4", "bf16")
"""The formats of the what-if table, in its column order."""

TABLE_WIDTH = 120
"""The terminal width the what-if table and its text lines are laid out for (long layer names
widen the table past it; the prose lines wrap)."""


@dataclass
class FormatCell:
    """One layer in one format."""

    available: bool
    reason: str = ""
    """Why the rules keep the layer out of the format (when not available)."""
    sqnr_out: float = math.nan
    sqnr_grad: float = math.nan
    underflow: float = math.nan
    saturation: float = math.nan
    flushed: float = math.nan
    """Share of the layer's inputs the format flushes or saturates (the guard's and the planner's
    measure, :func:`mixprec.monitor.replan.flushed_share`; the largest over the batches)."""
    loss_change: float = math.nan
    """Relative loss change with only this layer in this format."""
    speedup: float = 1.0
    """Projected GEMM speed-up over BF16 on the chosen GPU."""
    finite: bool = True
    """Whether the layer's output in this format was finite."""
    safe: bool = False
    why: str = ""
    """Why the cell is unsafe (empty when safe)."""


@dataclass
class WhatIfRow:
    name: str
    flops_per_token: int
    cells: dict[str, FormatCell] = field(default_factory=dict)
    choice: str = "fp32"


@dataclass
class WhatIfReport:
    """The what-if table, the choice per layer and its measured whole-model loss change."""

    rows: list[WhatIfRow]
    formats: list[str]
    gpu: str
    tolerance: float
    loss: float
    """Mean FP32 loss over the batches."""
    choice_loss_change: float = math.nan
    """Measured relative loss change with every layer in its chosen format."""
    choice_speedup: float = math.nan
    """Projected GEMM speed-up of the choice over all-BF16 (the measured Linears' GEMMs)."""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    min_sqnr_db: float | None = None
    """A user's SQNR limit for every format (None: each format's own)."""
    max_flush: float | None = None
    """A user's flushed-share limit for every format (None: each format's own)."""

    @property
    def choices(self) -> dict[str, str]:
        return {r.name: r.choice for r in self.rows}

    @property
    def overrides(self) -> tuple[tuple[str, str], ...]:
        """The choice as per-layer overrides (a plan: ``mixprec.policy.overrides.write_plan``)."""
        return tuple((r.name, r.choice) for r in self.rows)

    def table(self) -> str:
        """The terminal table, one compact cell per format (it fits ~120 columns for short layer
        names): the loss change in percent with ``!`` where unsafe, and the output SQNR; the
        projected speed-up under each format's name. Every other number is in :meth:`write_csv`."""
        rows = [GridRow(name=r.name, choice=r.choice,
                        cells=[_cell(r.cells[f]) if r.cells[f].available else None for f in self.formats])
                for r in self.rows]
        lines = layer_grid(rows, [_short(f) for f in self.formats], width=11, align=">",
                           what=[_subhead(self.rows, f) for f in self.formats],
                           choice="choice")
        given = self.min_sqnr_db is not None or self.max_flush is not None
        text = [f"cell: loss change with only this layer in the format (% of the loss; '!' = "
                f"unsafe: above {100 * self.tolerance:.3g}%, or outside the format's limits) and its "
                f"output SQNR (dB); x = projected GEMM speed-up over bf16 on {self.gpu}; gradient "
                "SQNR, underflow, saturation, inputs flushed and why a cell is unsafe: the CSV",
                "limits (output SQNR, inputs flushed; the guard's and the planner's): " + "; ".join(
                    f"{f} {format_limits(f, min_sqnr_db=self.min_sqnr_db, max_flush=self.max_flush).describe()}"
                    for f in self.formats) + (" (given)" if given else ""),
                f"choice: {format_counts(r.choice for r in self.rows)}; measured loss change "
                f"of the whole choice {100 * self.choice_loss_change:.3f}% of {self.loss:.4f}; "
                f"projected GEMM speed-up {self.choice_speedup:.2f}x; took {self.seconds:.1f} s",
                *self._over_tolerance(),
                *(f"note: {n}" for n in self.notes)]
        lines += [textwrap.fill(t, TABLE_WIDTH, subsequent_indent="  ") for t in text]
        return "\n".join(lines)

    def _over_tolerance(self) -> list[str]:
        """The choice is made layer by layer; its measured whole-model change can still exceed
        the per-layer tolerance (small changes add up), and then the table says so."""
        if not self.choice_loss_change > self.tolerance:
            return []
        return [f"warning: the whole choice changes the loss by {100 * self.choice_loss_change:.3g}%, "
                f"more than the {100 * self.tolerance:.3g}% each layer was allowed (the layers' "
                "changes add up); for a budget on the whole model use `mixprec plan --budget`"]

    def write_csv(self, path: str | Path) -> Path:
        """One row per layer; per format the column group ``FORMAT:sqnr_out_db``, ...; the choice.
        Each column names its unit: ``_db``, ``_frac`` (a fraction: 0.01 is the table's 1 %),
        ``_x`` (a speed-up factor)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        keys = ("available", "sqnr_out_db", "sqnr_grad_db", "underflow_frac", "saturation_frac",
                "flushed_frac", "loss_change_frac", "speedup_x", "safe", "reason")
        with p.open("w", newline="") as fh:
            out = csv.writer(fh)
            out.writerow(["layer", "flops_per_token", *(f"{f}:{k}" for f in self.formats for k in keys),
                          "choice"])
            for r in self.rows:
                vals: list[Any] = [r.name, r.flops_per_token]
                for f in self.formats:
                    c = r.cells[f]
                    vals += [int(c.available), _num(c.sqnr_out), _num(c.sqnr_grad), _num(c.underflow),
                             _num(c.saturation), _num(c.flushed), _num(c.loss_change),
                             f"{c.speedup:.3g}", int(c.safe), c.reason or c.why]
                out.writerow(vals + [r.choice])
            out.writerow(["# whole choice", "", f"measured loss change (fraction) {self.choice_loss_change:.6g}",
                          f"projected speed-up {self.choice_speedup:.4g}x on {self.gpu}",
                          f"tolerance (fraction) {self.tolerance:g}", f"fp32 loss {self.loss:.6g}"])
        return p

    def heatmap(self, path: str | Path) -> Path:
        """A PNG, layers x formats: colour = loss change (log scale), text = output SQNR in dB,
        a cross on unsafe cells, grey where the rules keep the layer out, a box on the choice."""
        from matplotlib.colors import LogNorm
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
        rows, fmts = self.rows, self.formats
        grid = torch.full((len(rows), len(fmts)), float("nan"))
        for i, r in enumerate(rows):
            for j, f in enumerate(fmts):
                c = r.cells[f]
                if c.available and math.isfinite(c.loss_change):
                    grid[i, j] = max(100 * c.loss_change, 1e-4)
        fig = Figure(figsize=(1.25 * len(fmts) + 3.2, 0.34 * len(rows) + 2.0))
        ax = fig.subplots()
        finite = grid[torch.isfinite(grid)]
        lo = float(finite.min()) if finite.numel() else 1e-4
        hi = max(float(finite.max()) if finite.numel() else 1.0, 100 * self.tolerance * 10, lo * 10)
        ax.set_facecolor("#d0d0d0")
        im = ax.imshow(grid.numpy(), aspect="auto", cmap="RdYlGn_r", norm=LogNorm(vmin=lo, vmax=hi))
        for i, r in enumerate(rows):
            for j, f in enumerate(fmts):
                c = r.cells[f]
                if not c.available:
                    ax.text(j, i, "n/a", ha="center", va="center", fontsize=7, color="#555555")
                    continue
                text = f"{c.sqnr_out:.0f} dB" + ("" if c.safe else "  \u2717")
                ax.text(j, i, text, ha="center", va="center", fontsize=7,
                        weight="normal" if c.safe else "bold")
            if r.choice in fmts:
                j = fmts.index(r.choice)
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=2.2, ec="black"))
        ax.set_xticks(range(len(fmts)))
        ax.set_xticklabels([f"{f}\n{_speedup_label(rows, f)}" for f in fmts], fontsize=8)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"{r.name} \u2192 {r.choice}" for r in rows], fontsize=7)
        ax.xaxis.tick_top()
        cb = fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02)
        cb.set_label("loss change with only this layer in this format (% of loss)", fontsize=8)
        cb.ax.axhline(100 * self.tolerance, color="black", lw=1.5)
        ax.set_title(f"what-if: safe = loss change \u2264 {100 * self.tolerance:.3g}% (line on the colour bar) "
                     f"and within the format's limits; "
                     f"\u2717 unsafe; box = choice\nwhole choice measured: loss change "
                     f"{100 * self.choice_loss_change:.3f}%, projected GEMM speed-up "
                     f"{self.choice_speedup:.2f}x over bf16 on {self.gpu}", fontsize=8)
        fig.tight_layout()
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(p, dpi=110)
        return p


def _cell(c: FormatCell) -> str:
    """The loss change in percent (``!``: unsafe) and the output SQNR in dB, 11 characters."""
    mark = " " if c.safe else "!"
    return f"{_pct(100 * c.loss_change):>6}{mark}{c.sqnr_out:>4.0f}"


def _pct(v: float) -> str:
    """A percentage in at most 6 characters, three decimals while small."""
    if not math.isfinite(v):
        return str(v)
    for digits in (3, 2, 1, 0):
        text = f"{v:.{digits}f}"
        if len(text) <= 6:
            return text
    return f"{v:.0e}"


def _short(fmt: str) -> str:
    """A column head of at most 10 characters: ``fp8-tensorwise`` -> ``fp8-tensor``."""
    return fmt.removesuffix("wise")


def _subhead(rows: list[WhatIfRow], fmt: str) -> str:
    """The line under a format's name, over its cells: its projected speed-up, ``%`` over the loss
    changes and ``dB`` over the SQNRs."""
    ups = [r.cells[fmt].speedup for r in rows if r.cells[fmt].available]
    return f"{f'x{max(ups):.1f}' if ups else '':<4} %   dB"


def _speedup_label(rows: list[WhatIfRow], fmt: str) -> str:
    ups = [r.cells[fmt].speedup for r in rows if r.cells[fmt].available]
    return f"x{max(ups):.1f} GEMM" if ups else "n/a"


def _num(v: float) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.6g}"


# --- range statistics -------------------------------------------------------------------------

def _fp8_counts(t: torch.Tensor, fmt: str, role: str) -> tuple[int, int, int]:
    from mixprec.formats import Fp8Config, quantize
    from mixprec.formats.fp8_linear import _operand_block
    cfg = Fp8Config.from_recipe(fmt)
    dtype = cfg.grad_dtype if role == "grad" else cfg.forward_dtype
    q = quantize(t, dtype, _operand_block(cfg, "weight" if role == "weight" else "act"),
                 margin=cfg.margin, power_of_two=cfg.power_of_two_scales)
    dq = q.dequantize()
    if q.block is None:
        scale = q.scale.expand_as(t)
    else:
        br, bc = q.block
        scale = q.scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[: t.shape[0], : t.shape[1]]
    from mixprec.formats.mx import SATURATION_LIMIT
    element = "e4m3" if dtype == torch.float8_e4m3fn else "e5m2"
    return _counts(t, dq, t.abs() / scale > SATURATION_LIMIT[element])


def _micro_counts(t: torch.Tensor, config, role: str) -> tuple[int, int, int]:
    from mixprec.formats import quantize_operand
    q = quantize_operand(t, config, grad=role == "grad", weight=role == "weight")
    return _counts(t, q.dequantize(), q.saturated(t))


def _counts(t: torch.Tensor, dq: torch.Tensor, saturated: torch.Tensor) -> tuple[int, int, int]:
    nz = t != 0
    return int(nz.sum()), int((nz & (dq == 0)).sum()), int((saturated & nz).sum())


def _range_stats(fmt: str, layer: nn.Module, records: list[tuple[torch.Tensor, ...]]
                 ) -> tuple[float, float]:
    """(underflow, saturation) shares over the layer's forward operands and output gradients."""
    x = torch.cat([r[0].reshape(-1, r[0].shape[-1]) for r in records]).float()
    w = layer.weight.detach().float()
    grads = [r[2].reshape(-1, r[2].shape[-1]).float() for r in records if len(r) > 2]
    operands = [(x, "act"), (w, "weight")] + ([(torch.cat(grads), "grad")] if grads else [])
    total = under = sat = 0
    for t, role in operands:
        if fmt.startswith("fp8-"):
            n, u, s = _fp8_counts(t, fmt, role)
        elif is_micro(fmt):
            n, u, s = _micro_counts(t, layer.config, role)
        else:
            dq = t.to(torch.bfloat16 if fmt == "bf16" else torch.float16).float()
            n, u, s = _counts(t, dq, torch.isinf(dq))
        total, under, sat = total + n, under + u, sat + s
    return (under / total, sat / total) if total else (0.0, 0.0)


def _flushed(records: list[tuple[torch.Tensor, ...]], fmt: str) -> float:
    """The largest share over the batches of the layer's inputs ``fmt`` flushes or saturates."""
    from mixprec.monitor.replan import flushed_share
    return float(torch.stack([flushed_share(r[0], fmt, "act") for r in records]).max())


def _unsafe(c: FormatCell, fmt: str, tolerance: float, peers: list[float],
            min_sqnr_db: float | None, max_flush: float | None) -> str:
    """Why a measured cell is unsafe ("" when it is safe): the loss, then the format's limits
    (output SQNR against its limit and against ``peers``, the other layers' in ``fmt``: the
    guard's and the planner's test, :func:`mixprec.monitor.gates.output_refusal`)."""
    limits = format_limits(fmt, min_sqnr_db=min_sqnr_db, max_flush=max_flush)
    why = []
    if not (c.finite and math.isfinite(c.loss_change)):
        why.append("non-finite output or loss")
    elif c.loss_change > tolerance:
        why.append(f"loss change {100 * c.loss_change:.3g}% > {100 * tolerance:.3g}%")
    bad = output_refusal(c.sqnr_out, fmt, peers, min_sqnr_db=min_sqnr_db)
    if bad:
        why.append(f"output {bad[0]}")
    if c.sqnr_grad < limits.min_grad_sqnr_db:             # (NaN: not measured, passes)
        why.append(f"weight-gradient SQNR {c.sqnr_grad:.1f} dB < {limits.min_grad_sqnr_db:g}")
    if c.flushed > limits.max_flush:
        why.append(f"{100 * c.flushed:.1f}% of its inputs flushed > {100 * limits.max_flush:.3g}%")
    return "; ".join(why)


# --- the what-if run ----------------------------------------------------------------------

def _peak(gpu, fmt: str) -> float | None:
    from mixprec.estimate.gpus import format_peak_kind
    value = getattr(gpu, f"{format_peak_kind(fmt)}_tflops")
    return None if value is None else float(value)


def what_if(model: nn.Module, batches: Sequence[Any], *, formats: Sequence[str] = WHATIF_FORMATS,
            gpu: str = "B200", tolerance: float = 5e-3,
            loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
            layers: Sequence[str] | None = None, seed: int = 0,
            min_sqnr_db: float | None = None, max_flush: float | None = None,
            progress: Callable[[str], None] | None = None) -> WhatIfReport:
    """Measure every Linear of ``model`` in every format of ``formats`` (module docstring).

    ``model``: an FP32 model (left untouched: the run works on copies). ``batches``: a few
    ``(inputs, targets)``; the loss is the model's as in ``fit()`` (``loss_fn(outputs, targets)``
    if given). ``gpu``: a name from the ``mixprec estimate`` table for the projected speed-ups
    (``B200``, ``GB200``, ``H100``, ...). ``tolerance``: the largest loss change, as a fraction of
    the loss, a layer may show alone in a format and be called safe (default 0.5 %).
    ``layers``: restrict to these Linear names. ``min_sqnr_db`` / ``max_flush``: replace every
    format's own limits (:mod:`mixprec.formats.limits`), as the guard's and the planner's do.
    """
    from mixprec.estimate.gpus import get_gpu
    from mixprec.models.objective import make_objective
    t0 = time.perf_counter()
    if not batches:
        raise ConfigError("what_if needs at least one batch")
    if not 0 < tolerance < 1:
        raise ConfigError(f"tolerance is a fraction of the loss in (0, 1), e.g. 0.005 for 0.5 %, "
                          f"not {tolerance}")
    fmts = list(dict.fromkeys(parse_format(f) for f in formats))
    if "fp32" in fmts:
        fmts.remove("fp32")                 # the reference itself
    spec = get_gpu(gpu)
    bf16_peak = float(spec.bf16_tflops)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    say = progress or (lambda s: None)

    ref_model = fp32_copy(model)
    Precision("32-true", device=device).setup(ref_model)
    ref_model.train()
    objective = make_objective(ref_model, Precision("32-true", device=device), loss_fn)
    planned = planned_layers(Precision("32-true", device=device), model, layers)
    names = planned.names
    if not names:
        raise ConfigError("the model has no Linear layer to ask about: "
                          + ("; ".join(planned.notes) or "it has no nn.Linear"))
    blocks = block_list(ref_model, linear_names(ref_model))
    block_calls: dict[str, list[Call]] = {}
    ref_losses, records = reference_pass(ref_model, batches, objective, names, seed, blocks, block_calls)
    ref_loss = sum(ref_losses) / len(ref_losses)
    variants, refused = format_variants(model, fmts, device)

    mods = dict(ref_model.named_modules())
    rows = [WhatIfRow(n, 6 * mods[n].in_features * mods[n].out_features) for n in names]
    for i, row in enumerate(rows):
        ref_out, ref_grad, _ = layer_alone(mods[row.name], records[row.name], input_grad=False)
        # The loss pass replays the blocks whose inputs it meets unchanged (those before the
        # layer) and the layer itself on its recorded inputs: the outputs are those computed.
        others = [b for b in blocks if not row.name.startswith(b + ".")]
        for f in fmts:
            if row.name in refused[f]:
                row.cells[f] = FormatCell(available=False, reason=refused[f][row.name])
                continue
            variant = variants[f].get_submodule(row.name)
            raw: list[torch.Tensor] = []
            out, grad, _ = layer_alone(variant, records[row.name], raw, input_grad=False)
            replay = Replay(variant, [Call(args=(r[0],), kwargs={}, output=y)
                                      for r, y in zip(records[row.name], raw)])
            losses = losses_with(ref_model, row.name, replay, batches, objective, seed,
                                 {b: Replay(mods[b], block_calls.get(b, ())) for b in others})
            change = sum(abs(a - b) for a, b in zip(losses, ref_losses)) / len(losses) / ref_loss
            under, sat = _range_stats(f, variant, records[row.name])
            peak = _peak(spec, f)
            cell = FormatCell(
                available=True, sqnr_out=sqnr_db(ref_out, out),
                sqnr_grad=sqnr_db(ref_grad, grad) if grad is not None and ref_grad is not None else math.nan,
                underflow=under, saturation=sat, loss_change=change,
                speedup=1.0 if peak is None else peak / bf16_peak)
            cell.flushed = _flushed(records[row.name], f)
            cell.finite = bool(torch.isfinite(out).all())
            row.cells[f] = cell
        say(f"[{i + 1}/{len(rows)}] {row.name}")
    del variants

    for f in fmts:                          # the verdicts: the other layers are the peers
        measured = {r.name: r.cells[f].sqnr_out for r in rows if r.cells[f].available}
        for r in rows:
            c = r.cells[f]
            if c.available:
                c.why = _unsafe(c, f, tolerance, [v for n, v in measured.items() if n != r.name],
                                min_sqnr_db, max_flush)
                c.safe = not c.why
    for row in rows:
        safe = [f for f in fmts if row.cells[f].available and row.cells[f].safe]
        row.choice = max(safe, key=lambda f: (row.cells[f].speedup, row.cells[f].sqnr_out)) if safe else "fp32"

    report = WhatIfReport(rows=rows, formats=fmts, gpu=spec.name, tolerance=tolerance, loss=ref_loss,
                          notes=list(planned.notes), min_sqnr_db=min_sqnr_db, max_flush=max_flush)
    chosen = fp32_copy(model)
    Precision("32-true", device=device, overrides=report.overrides).setup(chosen)
    chosen.train()
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        losses = [float(objective(chosen, batch).float()) for batch in batches]
    report.choice_loss_change = sum(abs(a - b) for a, b in zip(losses, ref_losses)) / len(losses) / ref_loss
    fp32_ratio = float(spec.fp32_tflops) / bf16_peak
    time_bf16 = sum(r.flops_per_token for r in rows)
    time_choice = sum(r.flops_per_token / (r.cells[r.choice].speedup if r.choice in r.cells else fp32_ratio)
                      for r in rows)
    report.choice_speedup = time_bf16 / time_choice
    report.notes += [
        f"speed-ups: {spec.name} dense datasheet peaks over its BF16 peak ({spec.source}); GEMMs of "
        "the measured Linears only",
        "numerics emulated where the device lacks the format (FP8 on CPUs, MX/NVFP4 everywhere for "
        "now); a loss change is that of one forward pass, training adds gradient error every step",
    ]
    report.seconds = time.perf_counter() - t0
    return report
