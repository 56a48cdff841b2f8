"""What a training run tells the user along the way: the start line, skipped steps traced to their
origin, and audit findings — on the console (rank 0) and in ``events.jsonl``.

A mixin of :class:`mixprec.train.Trainer`.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from mixprec.monitor import audit, format_findings
from mixprec.monitor.trace import gather_origins
from mixprec.precision.dtypes import dtype_name

if TYPE_CHECKING:
    from mixprec.train.metrics import MetricsLogger
    from mixprec.train.trainer import Batch, StepOutput

__all__ = ["RunEventsMixin"]


class RunEventsMixin:
    """Console lines and ``events.jsonl`` records of a run."""

    def _log_start(self, total: int, logger: MetricsLogger) -> None:
        if not self.strategy.is_main:
            return
        params = sum(p.numel() for p in self.strategy.unwrap(self.model).parameters())
        lines = [f"precision: {self.policy.describe()}",
                 f"device: {self.device} x {self.strategy.world_size} ({type(self.strategy).__name__})",
                 f"model: {params / 1e6:.2f}M parameters; steps: {self.step} -> {total}; "
                 f"peak-FLOPs dtype for MFU: {dtype_name(self.policy.compute_dtype)}",
                 f"run folder: {self.run_dir}"]
        if self.fp8_report is not None:
            lines.append(f"fp8: {self.fp8_report}")
        for line in lines:
            print(f"[mixprec] {line}", file=sys.stderr)
        logger.event({"kind": "start", "step": self.step, "message": "; ".join(lines)})

    def _on_skip(self, batches: list[Batch], out: StepOutput, rng: Any,
                 logger: MetricsLogger) -> str | None:
        """Log a skipped step, traced to the layer that produced the inf/NaN when enabled."""
        after = self.scaler.get_scale()
        event = (gather_origins(self.trace_nonfinite(batches, out, rng), self.strategy)  # all ranks
                 if self.config.trace_nonfinite else None)
        if event is not None:
            msg = event.message(self.step, out.scale_before, after)
            record = {**event.to_dict(), "kind": "skip", "nonfinite": event.kind,
                      "loss_scale_before": out.scale_before,
                      "loss_scale_after": after, "message": msg}
        else:
            msg = (f"step {self.step} skipped: non-finite gradients "
                   f"({dtype_name(self.policy.compute_dtype)}) — loss scale {out.scale_before:g} -> {after:g}")
            record = {"kind": "skip", "nonfinite": None, "step": self.step,
                      "loss_scale_before": out.scale_before,
                      "loss_scale_after": after, "message": msg}
        logger.event(record)
        if self.strategy.is_main and self.config.progress:
            from tqdm import tqdm
            tqdm.write(f"[mixprec] {msg}", file=sys.stderr)
        if event is None:
            return None
        return event.module if event.rank is None else f"{event.module} (rank {event.rank})"

    def _audit(self, logger: MetricsLogger) -> None:
        findings = audit(self.strategy.unwrap(self.model), policy=self.policy,
                         optimizer=self.optimizer, scaler=self.scaler, device=self.device)
        self._report(findings, logger)

    def _report(self, findings: list, logger: MetricsLogger) -> None:
        if not findings or not self.strategy.is_main:
            return
        print(format_findings(findings), file=sys.stderr)
        for f in findings:
            logger.event({"kind": "audit", "step": self.step, "code": f.code,
                          "severity": f.severity, "message": f"{f.message} (fix: {f.fix})"})
