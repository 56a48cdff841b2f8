"""``metrics.csv``'s ``skipped`` is the number of skipped steps among the row's ``steps`` (the row
is a mean over them), not the flag of the row's last step: a row covering steps 6-10 whose steps
7 and 8 skipped says 2 (it said 0, while ``skipped_total`` went 1 -> 3). Learned from the host's
skip counter at the row, with the outcome read lazily (no read added between log intervals:
tests/train/test_step_reads.py)."""
from __future__ import annotations

import pytest
import torch

from mixprec.runs.metrics import read_metrics
from mixprec.train.trainer import Trainer

from tests.train.test_trainer_step import Regressor, batches

_OVERFLOWS = (3, 7, 8)
"""Steps whose targets (x 1e4) overflow the FP16 backward at any loss scale the run reaches."""


@pytest.mark.parametrize("settle_each_step", [False, True])
def test_a_rows_skipped_counts_the_skipped_steps_of_its_interval(tmp_path, settle_each_step):
    torch.manual_seed(0)
    data = [(x, y * 1e4 if i + 1 in _OVERFLOWS else y) for i, (x, y) in enumerate(batches(12))]
    trainer = Trainer(Regressor(), run_dir=str(tmp_path / "run"), mixed_precision="16-mixed",
                      max_steps=12, log_interval=5, ckpt_interval=0, warmup_steps=0,
                      progress=False, audit=False, max_skipped_fraction=1.0)
    trainer.settle_each_step = settle_each_step
    result = trainer.fit(data)
    rows = [(r["step"], r["steps"], r["skipped"], r["skipped_total"]) for r in read_metrics(trainer.run_dir)]
    assert rows == [(5, 5, 1, 1), (10, 5, 2, 3), (12, 2, 0, 3)]
    assert result.skipped_steps == 3


def test_a_resumed_runs_first_row_counts_only_its_own_skips(tmp_path):
    """The count at the last row starts from the checkpoint's total, not from 0."""
    torch.manual_seed(0)
    data = [(x, y * 1e4 if i + 1 in _OVERFLOWS else y) for i, (x, y) in enumerate(batches(12))]
    run = str(tmp_path / "run")
    Trainer(Regressor(), run_dir=run, mixed_precision="16-mixed", max_steps=6, log_interval=3,
            ckpt_interval=3, warmup_steps=0, progress=False, audit=False, max_skipped_fraction=1.0).fit(data)
    again = Trainer(Regressor(), run_dir=run, mixed_precision="16-mixed", max_steps=9, log_interval=3,
                    ckpt_interval=3, warmup_steps=0, progress=False, audit=False, max_skipped_fraction=1.0)
    again.fit(data, resume=True)
    rows = [(r["step"], r["skipped"], r["skipped_total"]) for r in read_metrics(run)]
    assert rows == [(3, 1, 1), (6, 0, 1), (9, 2, 3)]
