"""The done-when of issue 25: each micro format trains mixprec's small model for 300 steps through
``mixprec train --precision NAME`` without a non-finite loss or a skipped step. In the suite
(CI) each format runs 30 steps (2026-12-01, load 14: 21 s of CPU for the three, startup included;
the suite used to run NVFP4 alone for 300 steps, ~50 s); ``MIXPREC_MICRO_300=1`` runs the full
300 steps of each (opt-in, ~2.5 CPU-minutes).

The batch is the smallest that keeps the claim (1 sequence of 16 tokens): the claim is about the
formats' numerics over 300 optimizer steps of the small model, not about throughput. Measured on
the shared 2-core AVX2 machine on 2026-12-01 at load average 15-20: 18 min 35 s of wall time for
the three, 2 min 29 s of CPU time (mxfp8 169 s wall, mxfp4 489 s, nvfp4 426 s); roughly 50 s of
CPU per format, most of it the emulated quantization and the emulated BF16 around it.
"""
from __future__ import annotations

import math
import os

import pytest

from mixprec.cli import main
from mixprec.runs.metrics import read_events, read_metrics


# What runs where. The suite (CI): each of the three formats trains the small model for
# STEPS_CI steps, all in this one process (~5 s of CPU per format). The done-when's 300 steps,
# each format: MIXPREC_MICRO_300=1 (about 50 s of CPU per format on an AVX2 machine), run for
# issue 25 (see the module docstring).
FORMATS = ["mxfp8", "mxfp4", "nvfp4"]
STEPS = 300 if os.environ.get("MIXPREC_MICRO_300") or os.environ.get("MIXPREC_ALL_MICRO_FORMATS") else 30


@pytest.mark.slow
@pytest.mark.parametrize("name", FORMATS)
def test_small_model_trains_in_the_format_without_non_finite_values(name, tmp_path):
    run_dir = tmp_path / name
    rc = main(["train", "model=small", "--precision", name, f"max_steps={STEPS}", "batch_size=1",
               "seq_len=16", "eval_interval=0", "eval_batches=1", "ckpt_interval=0",
               "log_interval=1", "progress=false", "audit=false", f"run_dir={run_dir}"])
    assert rc == 0
    rows = read_metrics(run_dir)
    losses = [r["loss"] for r in rows if r.get("loss") is not None]
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses)
    assert max(r.get("skipped_total") or 0 for r in rows) == 0
    assert math.isfinite(rows[-1]["val_loss"])
    assert sum(losses[-5:]) < sum(losses[:5])                       # it learns
    formats = next(e for e in read_events(run_dir) if e["kind"] == "formats")["layers"]
    assert sum(f == name for f in formats.values()) >= 12           # nvfp4 keeps the last block bf16
