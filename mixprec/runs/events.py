"""What a training run tells the user along the way: the start line, skipped steps traced to their
origin, and audit findings — on the console (rank 0) and in ``events.jsonl``.

:class:`RunEvents` gets what it reports from its arguments; it owns no training state.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

from torch import nn

from mixprec.precision import Precision
from mixprec.monitor import format_findings
from mixprec.monitor.trace import format_scale
from mixprec.policy.dtypes import dtype_name
from mixprec.policy.peak import no_peak_reason
from mixprec.strategies import Strategy
from mixprec.runs.metrics import MetricsLogger

__all__ = ["RunEvents"]


_SKIP_LINES_SHOWN = 5      # the first skipped steps are each reported on the terminal ...
_SKIP_LINE_EVERY = 100     # ... then at most one line per this many steps (all are in events.jsonl)


class RunEvents:
    """Console lines (rank 0) and ``events.jsonl`` records of a run.

    On a terminal, ``progress=True`` shows a progress bar; otherwise (a log file, a pipe,
    ``progress=False``) each log interval prints one plain line instead.
    """

    def __init__(self, strategy: Strategy, precision: Precision, logger: MetricsLogger, *,
                 progress: bool) -> None:
        self.strategy = strategy
        self.precision = precision
        self.logger = logger
        self.progress = progress and strategy.is_main and sys.stderr.isatty()
        self._bar = None
        self._skip_lines = 0
        self._last_skip_line = -_SKIP_LINE_EVERY
        self._skips_unsaid = 0
        self._t0, self._initial = time.perf_counter(), 0
        self._listed_layers = False    # the start lines listed every Linear's format

    def say(self, message: str) -> None:
        """One line on the terminal only (rank 0), above the progress bar if there is one."""
        self._say(message)

    def _say(self, message: str) -> None:
        if not self.strategy.is_main:
            return
        if self._bar is not None:
            self._bar.write(f"[mixprec] {message}", file=sys.stderr)
        else:
            print(f"[mixprec] {message}", file=sys.stderr, flush=True)

    # --- progress ----------------------------------------------------------------------------

    def open_progress(self, total: int, initial: int) -> None:
        """Start the clock of the run's elapsed time and ETA (and, on a terminal, the bar)."""
        self._t0, self._initial = time.perf_counter(), initial
        if self.progress:
            from tqdm import tqdm
            # {remaining} is tqdm's ETA; the postfix carries throughput, lr, loss (and the scale).
            self._bar = tqdm(total=total, initial=initial, dynamic_ncols=True, file=sys.stderr,
                             desc="train", unit="step",
                             bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                                        "[{elapsed}<{remaining}]{postfix}")

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def interval(self, step: int, total: int, *, loss: float, val_loss: float | None, lr: float,
                 tokens_per_s: float | None, samples_per_s: float | None = None,
                 steps: int | None = None, log_interval: int | None = None) -> None:
        """One log interval: the bar's numbers (an evaluation also leaves a line above the bar,
        so the validation history stays visible), or one plain line with elapsed time and ETA.
        ``steps``: the steps the row's loss averages, said when not ``log_interval`` of them
        (after a resume from mid-interval, say), as ``metrics.csv``'s ``steps`` column records."""
        rate = (f"{tokens_per_s:,.0f} tok/s" if tokens_per_s is not None else  # token ids
                f"{samples_per_s:,.1f} samples/s" if samples_per_s is not None else None)
        # Only modes that scale the loss have a scale worth showing (bf16/fp32: always 1).
        scaler = self.precision.scaler
        scale = f"scale {format_scale(scaler.get_scale())}" if self.precision.recipe.scales_loss else None
        skipped = self.precision.scaler.num_skipped_steps
        partial = steps and log_interval and steps != log_interval
        over = f" (mean of {steps} step{'s' if steps != 1 else ''})" if partial else ""
        fields = [rate, f"lr {lr:.3g}", f"loss {loss:.4f}{over}", scale,
                  f"skipped {skipped}" if skipped else None]
        if self._bar is not None:
            self._bar.set_postfix_str("  ".join(f for f in fields if f), refresh=False)
            if val_loss is None:
                return
        done = step - self._initial
        elapsed = time.perf_counter() - self._t0
        eta = elapsed / done * (total - step) if done > 0 else None
        from tqdm import tqdm
        clock = (f"elapsed {tqdm.format_interval(elapsed)}"
                 + (f"  ETA {tqdm.format_interval(eta)}" if eta is not None else ""))
        parts = [f"step {step}/{total}", f"loss {loss:.4f}{over}",
                 f"val {val_loss:.4f}" if val_loss is not None else None, *fields[:2], *fields[3:], clock]
        self._say("  ".join(p for p in parts if p))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def start(self, *, model: nn.Module, step: int, total: int, run_dir: Any,
              fp8_report: Any = None, watching: Sequence[str] = ()) -> None:
        """The start lines (terminal and ``events.jsonl``); ``watching``: the step hooks' own
        lines (the guard's limits, ...), after the layer formats."""
        if not self.strategy.is_main:
            return
        precision = self.precision
        params = sum(p.numel() for p in model.parameters())
        lines = [f"precision: {precision.describe()}", *precision.notes,
                 f"device: {self.strategy.device} x {self.strategy.world_size} "
                 f"({type(self.strategy).__name__})",
                 f"model: {_count(params)} parameters; steps: {step} -> {total}; " + _mfu_basis(
                     precision.layers.peak_format, self.strategy.device),
                 f"run folder: {run_dir}"]
        # The conversion reports list every module they converted or kept out; the terminal
        # gets their headline and ONE per-layer list (the formats table, with the reason a layer
        # was kept out); events.jsonl keeps the full reports.
        reports = [(name, r) for name, r in (("fp8", fp8_report), ("micro", precision.layers.micro_report))
                   if r is not None]
        full = lines + [f"{name}: {r}" for name, r in reports]
        lines += [f"{name}: {str(r).partition(chr(10))[0]}" for name, r in reports]   # whole first line
        if len(set(precision.layers.formats.values())) > 1 or precision.recipe.has_plan:
            why = {n: w for _, r in reports for n, w in getattr(r, "skipped", [])}
            table = ["layer formats:", *(f"  {row}" + (f"  ({why[n]})" if n in why else "")
                                         for n, row in zip(precision.layers.formats,
                                                           precision.layers.describe_lines()))]
            lines += table
            full += table
            self._listed_layers = True
        lines += watching
        full += watching
        for line in lines:
            print(f"[mixprec] {line}", file=sys.stderr)
        self.logger.event({"kind": "start", "step": step, "precision": precision.describe(),
                           "label": precision.recipe.label, "plan": precision.recipe.has_plan,
                           "watching": list(watching), "message": "; ".join(full)})
        self.logger.event({"kind": "formats", "step": step, "layers": dict(precision.layers.formats),
                           "message": f"{len(precision.layers.formats)} Linear layers: "
                                      + ", ".join(f"{n}={f}" for n, f in precision.layers.formats.items())})

    def skip(self, step: int, out: Any, origin_event: Any) -> None:
        """Log a skipped step (``out``: the step's :class:`~mixprec.train.step.StepOutput`), with the
        layer that produced the inf/NaN when it was traced."""
        after = self.precision.scaler.get_scale()
        if origin_event is not None:
            msg = origin_event.message(step, out.scale_before, after)
            record = {**origin_event.to_dict(), "kind": "skip", "nonfinite": origin_event.kind,
                      "loss_scale_before": out.scale_before, "loss_scale_after": after, "message": msg}
        else:
            msg = (f"step {step} skipped: non-finite gradients "
                   f"({dtype_name(self.precision.recipe.compute_dtype)}) — loss scale "
                   f"{format_scale(out.scale_before)} -> {format_scale(after)}")
            record = {"kind": "skip", "step": step, "nonfinite": None, "loss_scale_before": out.scale_before,
                      "loss_scale_after": after, "message": msg}
        self.logger.event(record)
        # Every skipped step is in events.jsonl; the terminal hears of the first few, then at
        # most one per _SKIP_LINE_EVERY steps, with the count of those not shown.
        if self._skip_lines < _SKIP_LINES_SHOWN or step - self._last_skip_line >= _SKIP_LINE_EVERY:
            more = f" ({self._skips_unsaid} more skipped steps not shown)" if self._skips_unsaid else ""
            self._say(msg + more)
            self._skip_lines += 1
            self._last_skip_line = step
            self._skips_unsaid = 0
            if self._skip_lines == _SKIP_LINES_SHOWN:     # said once: the lines thin out from here
                self._say(f"further skipped steps are recorded in events.jsonl only, apart from one "
                          f"line here per {_SKIP_LINE_EVERY} steps")
        else:
            self._skips_unsaid += 1

    def format_switch(self, switch: Any) -> None:
        """A layer changed format while training (re-planning): terminal and events.jsonl."""
        self.logger.event(switch.to_dict())
        self._say(switch.message)

    def guard(self, action: Any) -> None:
        """What the training guard did (a promotion is also a ``format`` record): events.jsonl
        and the terminal (a give-up is said by the error that ends the run)."""
        self.logger.event(action.to_dict())
        if action.kind != "give-up":
            self._say(action.message)

    def note(self, message: str, step: int, kind: str = "note", *, say: bool = True) -> None:
        """An ``events.jsonl`` record, also said on the terminal (rank 0) unless ``say=False``
        (an error that ends the run says it itself)."""
        self.logger.event({"kind": kind, "step": step, "message": message})
        if say:
            self._say(message)

    def data_position(self, message: str | None, step: int) -> None:
        """The training data's position cannot be restored: said on the terminal and recorded
        (``{"kind": "data", "exact": false}``) so a resumed run's data order is not a surprise."""
        if message is not None:
            self.logger.event({"kind": "data", "step": step, "exact": False, "message": message})
            self._say(message)

    def findings(self, findings: list, step: int) -> None:
        if not findings or not self.strategy.is_main:
            return
        # The layer-formats finding repeats the table the start lines printed: recorded only.
        shown = [f for f in findings if not (self._listed_layers and f.code == "layer-formats")]
        if shown:
            print(format_findings(shown), file=sys.stderr)
        for f in findings:
            self.logger.event({"kind": "audit", "step": step, "code": f.code,
                               "severity": f.severity, "message": f"{f.message} (fix: {f.fix})"})


def _count(n: int) -> str:
    """``0.86M`` from 100k parameters up; the exact count below (``0.00M`` said nothing)."""
    return f"{n / 1e6:.2f}M" if n >= 100_000 else f"{n:,}"


def _mfu_basis(fmt: str, device: Any) -> str:
    """What the run's MFU is measured against, or why it is not measured (one clause)."""
    why = no_peak_reason(fmt, device)
    return f"MFU not measured: {why}" if why else f"peak-FLOPs format for MFU: {fmt}"
