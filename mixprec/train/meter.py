"""Throughput, MFU, memory and the loss of each logged interval of a run.

A row covers the training steps since the previous row (``steps``: fewer than ``log_interval``
after a resume from mid-interval, or at an evaluation or the last step). Its ``time_s``,
``tokens_per_s`` and ``mfu`` count training only: an evaluation's time is ``eval_s``, apart."""
from __future__ import annotations

import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from mixprec.models.objective import add_tokens, count_samples
from mixprec.precision import Precision
from mixprec.models.flops import model_flops
from mixprec.policy.peak import format_peak_flops, format_peak_source, low_peak_reason
from mixprec.strategies import Strategy
from mixprec.runs.metrics import MetricsLogger
from mixprec.train.step import StepOutput

__all__ = ["IntervalMeter", "peak_memory_mb"]


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class IntervalMeter:
    """Throughput, MFU and the loss of each logged interval (one host sync per interval)."""

    def __init__(self, strategy: Strategy, precision: Precision, model: nn.Module,
                 logger: MetricsLogger, *, note: Callable[[str], None] = lambda message: None) -> None:
        self.strategy, self.precision, self.logger = strategy, precision, logger
        self.device = strategy.device
        self.note = note          # one line to the run's terminal and events.jsonl
        # The peak of the format the mode's GEMMs run in (fp8 for fp8-*), as `mixprec estimate`
        # uses; None where this device has no such GEMMs (emulated): MFU is then not measured.
        self.peak = format_peak_flops(precision.layers.peak_format, self.device)
        if self.peak is not None and strategy.is_main:
            self.note(f"MFU peak: {precision.layers.peak_format.upper()} {self.peak / 1e9:.3g} GFLOP/s, "
                      + format_peak_source(precision.layers.peak_format, self.device))
        elif strategy.is_main and (low := low_peak_reason(precision.layers.peak_format, self.device)):
            self.note(f"MFU not measured: the {precision.layers.peak_format.upper()} peak measured now "
                      f"is not trusted ({low}); it was not cached")
        self.counted_flops = hasattr(model, "flops_per_token")
        # A model that does not count its own: matmul parameters (no embedding look-ups) and the
        # attention term at the batches' mean sequence length (docs/estimates.md).
        self.model_flops = None if self.counted_flops else model_flops(model)
        self.flops_per_token = (model.flops_per_token() if self.counted_flops
                                else self.model_flops.per_token(None))
        self.refreshed = False
        self.last_tps: float | None = 0.0
        self.last_sps: float | None = None   # samples/s, for batches without token ids
        self.last_steps = 0                  # steps the last row averaged
        # The skipped-step count at the last row (a host counter, no read): a row's ``skipped``
        # is the difference, the skips among its ``steps``, whichever step of them skipped.
        self.skipped_before = precision.scaler.num_skipped_steps
        self._reset()

    def _reset(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.tokens: torch.Tensor | int | None = 0   # real tokens; None when batches have none
        self.samples: int | None = 0                  # examples (counted from shapes: no sync)
        self.t0 = time.perf_counter()
        self.eval_s = 0.0                             # evaluation time, kept out of throughput

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """``with meter.evaluating(): ...``: time spent inside is the row's ``eval_s`` and is not
        training time (``time_s``, ``tokens_per_s`` and ``mfu`` leave it out)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.eval_s += time.perf_counter() - start

    def add(self, out: StepOutput, batches: list | tuple = ()) -> None:
        """One step's output; ``batches`` (its micro-batches) count samples for samples/s."""
        self.losses.append(out.loss)
        self.tokens = add_tokens(self.tokens, out.tokens)
        for b in batches:
            n = count_samples(b)
            self.samples = None if n is None or self.samples is None else self.samples + n

    def log(self, out: StepOutput, *, step: int, epoch: int, lr: float, val_loss: float | None) -> float:
        """Write the interval's metrics row; return its mean loss (agreed across ranks)."""
        strategy, precision = self.strategy, self.precision
        # One host sync per logged interval: the losses of the interval come back together.
        # Tokens counted from attention masks are device tensors: they come back in the same sync.
        counted = isinstance(self.tokens, torch.Tensor)
        values = torch.stack(self.losses).double()
        values = torch.cat([values, self.tokens.double().reshape(1)]) if counted else values
        values = values.tolist()
        tokens = values.pop() if counted else self.tokens
        loss = strategy.reduce_mean(sum(values) / len(values))
        steps = len(self.losses)
        elapsed = time.perf_counter() - self.t0 - self.eval_s   # training steps only
        tps = mfu = None
        if tokens is not None:                    # None: inputs without token ids (images)
            tps = tokens * strategy.world_size / elapsed
            if self.model_flops is not None:      # the attention term needs the sequence length
                seq = tokens / self.samples if self.samples else None
                self.flops_per_token = self.model_flops.per_token(seq)
            if self.peak:                         # no peak: no FP8/FP4 GEMM rule for this mode
                mfu = tps / strategy.world_size * self.flops_per_token / self.peak
        if mfu is not None and mfu > 1.0 and not self.refreshed:
            # The cached peak was measured on a busy machine: measure it again.
            self.refreshed = True
            self.peak = format_peak_flops(precision.layers.peak_format, self.device, refresh=True)
            mfu = tps / strategy.world_size * self.flops_per_token / self.peak
        if mfu is not None and mfu > 1.0:
            # Still above the measured peak: the peak cannot be trusted here; no MFU from now on.
            counted = ("the model's flops_per_token()" if self.counted_flops else
                       self.model_flops.describe(tokens / self.samples if self.samples else None))
            self.note(f"MFU not measured from step {step} on: {mfu:.0%} of the measured "
                      f"{precision.layers.peak_format.upper()} peak ({self.peak / 1e9:.1f} GFLOP/s), so the "
                      f"peak (measured while other jobs ran?) or the FLOPs per token ({counted}) "
                      "is not this run's")
            self.peak = mfu = None
        # The row's steps were concluded before it (fit() does so at a log interval): the total is
        # the host's count, read with the step's flag, no extra read.
        skipped_total = precision.scaler.num_skipped_steps
        self.logger.log(step, epoch=epoch, loss=loss, val_loss=val_loss,
                        lr=lr, loss_scale=precision.scaler.get_scale(),
                        skipped=skipped_total - self.skipped_before, skipped_total=skipped_total,
                        grad_norm=float(out.grad_norm) if out.grad_norm is not None else None,
                        tokens_per_s=tps, mfu=mfu,
                        peak_mem_mb=peak_memory_mb(self.device), time_s=elapsed,
                        steps=steps, eval_s=self.eval_s if self.eval_s else None)
        self.last_tps, self.last_steps = tps, steps
        self.skipped_before = skipped_total
        self.last_sps = (self.samples * strategy.world_size / elapsed
                         if tokens is None and self.samples else None)
        self._reset()
        return loss
