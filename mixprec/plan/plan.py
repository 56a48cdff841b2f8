"""A per-layer precision plan: what the planner measured, the choice, and how it is shown.

:class:`PrecisionPlan` holds one :class:`LayerMeasure` per Linear; :func:`choose` spends the loss
budget greedily (see :mod:`mixprec.plan.planner`); :func:`format_throughput` gives the FLOP/s per
format the step-time model uses (measured here, or a GPU's datasheet).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mixprec.formats.limits import format_limits
from mixprec.monitor.gates import MAX_SQNR_DROP_DB
from mixprec.plan.grid import GridRow, format_counts, layer_grid
from mixprec.policy.overrides import LAYER_FORMATS, format_dtype, is_micro, write_plan
from mixprec.precision import Precision

__all__ = ["PrecisionPlan", "LayerMeasure", "format_throughput", "choose", "safer_format",
           "update_times"]


@dataclass
class LayerMeasure:
    """What the planner measured for one Linear."""

    name: str
    flops_per_token: int
    """Training GEMM FLOPs per token: ``6 * in_features * out_features``."""
    flops_share: float = 0.0
    """Share of all measured Linears' GEMM FLOPs."""
    sqnr_out: dict[str, float] = field(default_factory=dict)
    """Output SQNR against FP32 (dB) per format."""
    sqnr_grad: dict[str, float] = field(default_factory=dict)
    """Weight-gradient SQNR (dB) per format."""
    sqnr_dgrad: dict[str, float] = field(default_factory=dict)
    """Input-gradient SQNR (dB) per format: the error this layer sends back to the layers below."""
    flush_in: dict[str, float] = field(default_factory=dict)
    """Share of the layer's non-zero inputs the format flushes to zero or saturates."""
    flush_grad: dict[str, float] = field(default_factory=dict)
    """... of its output gradients (FP8: in the recipe's gradient format)."""
    loss_change: dict[str, float] = field(default_factory=dict)
    """Measured relative loss change per format with only this layer in it (fraction of the FP32
    loss, mean over the calibration batches of ``|loss_f - loss_fp32|``)."""
    loss_change_est: dict[str, float] = field(default_factory=dict)
    """Second-order (Fisher) estimate of the relative loss increase per format."""
    unavailable: dict[str, str] = field(default_factory=dict)
    """Formats this layer cannot run in, and why (FP8 rules)."""
    risky: dict[str, str] = field(default_factory=dict)
    """Formats the sensitivity gates refuse for this layer (:func:`mixprec.monitor.gates.gate`), and why."""
    severity: dict[str, float] = field(default_factory=dict)
    """... and how far over its worst limit each is (> 1)."""
    chosen: str = "fp32"
    current: str = "fp32"
    """The format it computes in under the base mode, as the per-layer table says
    (:meth:`mixprec.Precision.resolve`): the baseline of the plan's speed-up."""

    def sensitivity(self, fmt: str) -> tuple[int, float, float]:
        """The ranking key of ``fmt`` for this layer, larger = more sensitive: refused by a gate
        first (the furthest over its limit first), then the estimated loss change."""
        return (int(fmt in self.risky), self.severity.get(fmt, 0.0), self.loss_change_est.get(fmt, 0.0))


def safer_format(m: LayerMeasure, cands: Sequence[str]) -> str | None:
    """The next more accurate candidate ``m`` can run in than the one it has (the order of
    :data:`LAYER_FORMATS`: fp32, bf16, fp16, FP8 recipes), or None at the most accurate."""
    avail = sorted((f for f in cands if f in m.loss_change), key=LAYER_FORMATS.index)
    idx = avail.index(m.chosen) if m.chosen in avail else 0
    return avail[idx - 1] if idx > 0 else None


@dataclass
class PrecisionPlan:
    """A plan: one format per Linear, the measurements behind it, and what it is estimated to save."""

    base: str
    """The mode everything outside the planned Linears runs in (the plan file's ``precision``)."""
    layers: list[LayerMeasure]
    throughput: dict[str, float]
    """FLOP/s per format used for the cost."""
    target: str
    budget: float
    criterion: str
    """``fisher`` (budget spent on the estimated loss increase) or ``measured``."""
    loss: float
    """Mean FP32 calibration loss."""
    step_time: float = 0.0
    """Estimated GEMM seconds per token under the plan."""
    step_time_fp32: float = 0.0
    step_time_fastest: float = 0.0
    """... with every layer in its fastest available candidate, ignoring the budget."""
    step_time_base: float = 0.0
    """... with every layer in the format the base mode runs it in (its ``current``)."""
    base_format: str = "fp32"
    """The base mode's own Linear format (``bf16`` under ``bf16-mixed``)."""
    spent: float = 0.0
    """What the first choice spent of the budget: the summed criterion (estimate or single-layer
    measured change) of the chosen formats."""
    loss_change_est: float = 0.0
    """Summed estimated loss change of the final plan's formats."""
    measured_calibration: float = 0.0
    """Measured relative loss change of the whole plan on the calibration batches."""
    measured_heldout: float | None = None
    """... on the held-out batches (None when there were none)."""
    loss_change: float = 0.0
    """What the plan promises: the larger of the two measured whole-plan changes (within budget
    unless every layer is at its most accurate format; see ``notes``)."""
    calibration_tokens: int = 0
    heldout_tokens: int = 0
    demoted: list[dict] = field(default_factory=list)
    """Layers moved back after the whole plan measured over budget: ``layer``, ``from``, ``to``,
    ``calibration`` and ``heldout`` (the whole plan's changes after the move)."""
    min_sqnr_db: float | None = None
    """A user's SQNR limit for every format (None: each format's own, :mod:`mixprec.formats.limits`)."""
    max_flush: float | None = None
    """A user's flushed-share limit for every format (None: each format's own)."""
    max_sqnr_drop_db: float = MAX_SQNR_DROP_DB
    seconds: float = 0.0
    """Wall time the planner took."""
    notes: list[str] = field(default_factory=list)
    linears: list[str] | None = None
    """Every Linear layer of the model planned for (the plan file's ``linears``: a model whose
    Linear layers differ is refused, :class:`mixprec.policy.overrides.PlanOrigin`)."""
    made_for: str = ""
    """The model settings planned with (``"model=tiny"``; ``mixprec plan`` sets it)."""

    @property
    def formats(self) -> dict[str, str]:
        return {m.name: m.chosen for m in self.layers}

    @property
    def overrides(self) -> tuple[tuple[str, str], ...]:
        """Exact layer names -> format (no wildcards, so order does not matter)."""
        return tuple((m.name, m.chosen) for m in self.layers)

    def precision(self, **kwargs: Any) -> Precision:
        """A :class:`mixprec.Precision` running this plan."""
        return Precision(self.base, overrides=self.overrides, **kwargs)

    def write(self, path: str | Path) -> Path:
        """The plan file (JSON with the measurements, or TOML with the formats only)."""
        return write_plan(path, self.base, self.overrides, made_for=self.made_for,
                          linears=self.linears, target=self.target, budget=self.budget,
                          criterion=self.criterion,
                          loss=self.loss, step_time=self.step_time, step_time_fp32=self.step_time_fp32,
                          step_time_base=self.step_time_base, speedup=self.speedup(),
                          loss_change=self.loss_change, loss_change_est=self.loss_change_est,
                          measured_calibration=self.measured_calibration,
                          measured_heldout=self.measured_heldout,
                          calibration_tokens=self.calibration_tokens,
                          heldout_tokens=self.heldout_tokens, demoted=self.demoted,
                          min_sqnr_db=self.min_sqnr_db, max_flush=self.max_flush,
                          max_sqnr_drop_db=self.max_sqnr_drop_db,
                          throughput=self.throughput,
                          planner_seconds=self.seconds, notes=self.notes,
                          layers=[_finite(asdict(m)) for m in self.layers])

    def speedup(self) -> float:
        """Predicted Linear-GEMM speed-up of the plan over the base mode as it runs each Linear."""
        return self.step_time_base / self.step_time if self.step_time else 1.0

    def tradeoff(self) -> str:
        """The trade-off in one line: predicted speed-up next to the measured loss change."""
        where = "this machine" if self.target == "measure" else self.target
        held = (f"{100 * self.measured_heldout:.3g}% on {self.heldout_tokens} held-out tokens, "
                if self.measured_heldout is not None else "")
        return (f"predicted {self.speedup():.2f}x faster Linear GEMMs than {self.base} on "
                f"{where}, for a measured loss change of {held}{100 * self.measured_calibration:.3g}% "
                f"on {self.calibration_tokens} calibration tokens (budget {100 * self.budget:.3g}%)")

    def table(self) -> str:
        """The planner's table: per layer and format the SQNRs (output / input gradient / weight
        gradient), the flushed share, the measured single-layer and the estimated loss change;
        the choice; then the whole plan: estimated and measured (calibration, held-out)."""
        fmts = [f for f in self._formats() if f != "fp32"]
        rows = [GridRow(name=m.name, lead=f"{100 * m.flops_share:.1f}%", choice=m.chosen,
                        cells=[None if f in m.unavailable else _cell(m, f) for f in fmts])
                for m in self.layers]
        lines = layer_grid(rows, [_short(f) for f in fmts], what=_CELL_HEAD, width=len(_CELL_HEAD),
                           lead=("flops", "share"), name_width=22)  # HF names run long
        if any(m.risky for m in self.layers):
            lines.append(f"! before a cell: refused by the sensitivity gates (an output SQNR below "
                         f"the format's limit, a gradient SQNR 5 dB below that, an output SQNR "
                         f"{self.max_sqnr_drop_db:g} dB below the other layers', or more flushed "
                         f"than the format's limit)")
        if fmts:
            lines.append("limits: " + "; ".join(
                f"{_short(f)} {format_limits(f, min_sqnr_db=self.min_sqnr_db, max_flush=self.max_flush).describe()}"
                for f in fmts) + (" (given)" if self.min_sqnr_db is not None or self.max_flush is not None
                                  else " (each format's own: docs/per-layer.md)"))
        lines.append(f"plan: {format_counts(m.chosen for m in self.layers)}; base {self.base}")
        held = (f", measured {100 * self.measured_heldout:.3g}% on {self.heldout_tokens} held-out tokens"
                if self.measured_heldout is not None else ", no held-out batch")
        lines.append(f"whole-plan loss change (% of {self.loss:.4f}): estimated "
                     f"{100 * self.loss_change_est:.3g}%, measured {100 * self.measured_calibration:.3g}% "
                     f"on {self.calibration_tokens} calibration tokens{held}; budget "
                     f"{100 * self.budget:.3g}%" + ("" if self.loss_change <= self.budget else
                                                    " (over budget at the most accurate formats)"))
        for d in self.demoted:
            lines.append(f"moved back after measuring the whole plan: {d['layer']} {d['from']} -> {d['to']}")
        lines.append(f"GEMM time per token {self.step_time / self.step_time_fp32:.3f}x of all-fp32 "
                     f"(fastest possible {self.step_time_fastest / self.step_time_fp32:.3f}x) at "
                     f"{self.target} throughput; planner took {self.seconds:.1f} s")
        lines.append(f"trade-off: {self.tradeoff()}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _formats(self) -> list[str]:
        seen = []
        for m in self.layers:
            for f in [*m.sqnr_out, *m.unavailable]:
                if f not in seen:
                    seen.append(f)
        return sorted(seen, key=LAYER_FORMATS.index)

    def plot(self, path: str | Path) -> Path:
        """A PNG: output SQNR per layer and format (bars), the chosen format marked."""
        from matplotlib.figure import Figure
        fmts = [f for f in self._formats() if f != "fp32"]
        names = [m.name for m in self.layers]
        fig = Figure(figsize=(max(6, 0.5 * len(names) + 2), 6))
        ax, ax2 = fig.subplots(2, 1, sharex=True)
        width = 0.8 / max(len(fmts), 1)
        for i, f in enumerate(fmts):
            xs = [j + (i - (len(fmts) - 1) / 2) * width for j in range(len(names))]
            ax.bar(xs, [min(m.sqnr_out.get(f, 0.0), 80) for m in self.layers], width, label=f)
            ax2.bar(xs, [100 * m.loss_change.get(f, 0.0) for m in self.layers], width, label=f)
        ax.set_ylabel("output SQNR vs fp32 (dB)")
        ax2.set_ylabel("loss change (% of loss)")
        ax2.set_yscale("symlog", linthresh=1e-3)
        # The plan keeps the summed loss change of its choices within this budget.
        ax2.axhline(100 * self.budget, color="tab:red", ls="--", lw=1.0,
                    label=f"budget {100 * self.budget:.3g}% (sum over layers)")
        # Legends right of the axes: inside, they covered the last layers' bars (none on an axis
        # without a labelled bar: an all-fp32 plan draws none, and matplotlib would warn).
        for a in (ax2, ax):
            if a.get_legend_handles_labels()[0]:
                a.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        ax2.set_xticks(range(len(names)))
        ax2.set_xticklabels([f"{n}\n[{m.chosen}]" for n, m in zip(names, self.layers)], rotation=90,
                            fontsize=7)
        ax.set_title(f"per-layer sensitivity; chosen format in brackets (base {self.base}, "
                     f"budget {100 * self.budget:.3g}%)", fontsize=9)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100, bbox_inches="tight")
        return path


_CELL_HEAD = f" {'sqnr o/dx/dw dB':<15} {'flush%':>6} {'dloss% meas/est':<17}"
"""The sub-header over each format's cells, column for column (:func:`_cell`)."""


def _cell(m: LayerMeasure, f: str) -> str:
    """``!`` in front when a sensitivity gate refused the format (the gates read the SQNRs and
    the flushed share, not the loss change), then the SQNRs out/dgrad/wgrad, the flushed share,
    the measured/estimated loss change: each under its head in :data:`_CELL_HEAD`."""
    flush = 100 * max(m.flush_in.get(f, 0.0), m.flush_grad.get(f, 0.0))
    mark = "!" if f in m.risky else " "
    sqnr = "/".join(_db(v) for v in (m.sqnr_out[f], m.sqnr_dgrad.get(f, float("nan")), m.sqnr_grad[f]))
    change = f"{100 * m.loss_change[f]:.2g}/{100 * m.loss_change_est[f]:.2g}"
    return f"{mark}{sqnr:<15} {flush:>6.2g} {change:<17}"


def _db(v: float) -> str:
    """An SQNR in 4 characters (``28.6``, `` 120``, `` inf``)."""
    return f"{v:4.1f}" if abs(v) < 99.95 else f"{v:4.0f}"


def _short(fmt: str) -> str:
    return fmt.replace("fp8-", "fp8/")


def _finite(d: dict) -> dict:
    """JSON has no inf: an exact match (infinite SQNR) is written as 999 dB."""
    def fix(v):
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        return 999.0 if isinstance(v, float) and v == float("inf") else v
    return fix(d)


def format_throughput(target: str, candidates: Sequence[str], *, device: torch.device,
                      n: int = 512, min_time: float = 0.1) -> tuple[dict[str, float], list[str]]:
    """FLOP/s per candidate format: measured here (``target="measure"``) or a GPU's datasheet."""
    notes: list[str] = []
    if target != "measure":
        from mixprec.estimate.gpus import GPUS, format_peak_kind, get_gpu
        gpu = get_gpu(target)
        out = {}
        for f in candidates:
            kind = format_peak_kind(f)
            value = getattr(gpu, f"{kind}_tflops")
            if value is None:
                has = " or ".join(g.name for g in GPUS.values() if getattr(g, f"{kind}_tflops") is not None)
                notes.append(f"{f} left out: it gives no speed-up on {gpu.name} (no {kind.upper()} "
                             f"tensor cores); pick --target {has} to plan for {kind.upper()}")
                continue
            out[f] = value * 1e12
        notes.append(f"throughput: {gpu.name} dense datasheet peaks ({gpu.source})")
        return out, notes
    from mixprec.policy.peak import time_matmul
    from mixprec.policy import hardware
    out = {}
    fp8_native = device.type == "cuda" and hardware.cuda_supports_fp8()
    for f in candidates:
        if is_micro(f):
            notes.append(f"{f} left out: no block-scaled GEMMs here (it would be emulated, slower "
                         "than fp32); plan for a Blackwell GPU with target='B200'")
            continue
        if f.startswith("fp8-"):
            if not fp8_native:
                notes.append(f"{f} left out: no FP8 GEMMs on {device.type} (it would be emulated, "
                             "slower than fp32); plan for a GPU with target='H100'")
                continue
            if "fp8" not in out:
                out["fp8"] = time_matmul("fp8", None, device, n, min_time)
            out[f] = out["fp8"]
        else:
            out[f] = time_matmul(f, format_dtype(f), device, n, min_time)
    out.pop("fp8", None)
    notes.append(f"throughput: measured on {device.type} with {n}x{n} GEMMs: " +
                 ", ".join(f"{f} {v / 1e9:.0f} GFLOPS" for f, v in out.items()))
    return out, notes


def choose(plan: PrecisionPlan, cands: list[str]) -> None:
    """Greedy: most accurate first, then the best time saved per loss change within the budget."""
    thr = plan.throughput

    def t(m: LayerMeasure, f: str) -> float:
        return m.flops_per_token / thr[f]

    avail = {m.name: [f for f in cands if f in m.loss_change and f not in m.risky]
             for m in plan.layers}
    cost = {m.name: (m.loss_change_est if plan.criterion == "fisher" else m.loss_change)
            for m in plan.layers}
    for m in plan.layers:
        m.chosen = "fp32"
    used = 0.0
    while True:
        best = None
        for m in sorted(plan.layers, key=lambda m: m.name):
            cur = m.chosen
            for g in avail[m.name]:
                gain = t(m, cur) - t(m, g)
                if gain <= 0:
                    continue
                dc = cost[m.name][g] - cost[m.name][cur]
                if used + dc > plan.budget:
                    continue
                key = (gain / max(dc, 1e-15), gain)
                if best is None or key > best[0]:
                    best = (key, m, g, dc)
        if best is None:
            break
        _, m, g, dc = best
        m.chosen = g
        used += dc
    # Free improvements: a format as fast as the chosen one with a smaller loss change (two FP8
    # recipes at the same datasheet throughput, whose ratios tied when both changes were ~0).
    for m in plan.layers:
        better = [g for g in avail[m.name]
                  if t(m, g) <= t(m, m.chosen) and cost[m.name][g] < cost[m.name][m.chosen]]
        if better:
            g = min(better, key=lambda g: (cost[m.name][g], t(m, g)))
            used += cost[m.name][g] - cost[m.name][m.chosen]
            m.chosen = g
    plan.spent = used
    update_times(plan)


def update_times(plan: PrecisionPlan) -> None:
    """The plan's estimated GEMM times and summed estimate, from its current choices."""
    thr = plan.throughput

    def t(m: LayerMeasure, f: str) -> float:
        return m.flops_per_token / thr[f]

    plan.loss_change_est = sum(m.loss_change_est.get(m.chosen, 0.0) for m in plan.layers)
    plan.step_time = sum(t(m, m.chosen) for m in plan.layers)
    plan.step_time_fp32 = sum(t(m, "fp32") for m in plan.layers)
    base = plan.base_format if plan.base_format in thr else "fp32"
    plan.step_time_base = sum(t(m, m.current if m.current in thr else base) for m in plan.layers)
    plan.step_time_fastest = sum(min(t(m, f) for f in thr if f in m.loss_change and f not in m.risky)
                                 for m in plan.layers)
