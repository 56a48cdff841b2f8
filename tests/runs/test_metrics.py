"""MetricsLogger and the readers: contract columns, flushing, resume truncation, TensorBoard."""
from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest
import torch

from mixprec.runs.metrics import (METRICS_COLUMNS, NUMERICS_COLUMNS, MetricsLogger, read_events,
                                   read_metrics, read_numerics)


def _header(path):
    with open(path, newline="") as f:
        return next(csv.reader(f))


def test_columns_match_the_contract():
    assert METRICS_COLUMNS == ("step", "epoch", "loss", "val_loss", "lr", "loss_scale", "skipped",
                               "skipped_total", "grad_norm", "tokens_per_s", "mfu", "peak_mem_mb", "time_s",
                               "steps", "eval_s")
    assert NUMERICS_COLUMNS == ("step", "module", "kind", "absmax", "overflow_frac", "underflow_frac", "dtype",
                                "subnormal_frac", "loss_scale")


def test_log_writes_fixed_columns_missing_cells_empty_and_reads_back_typed(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log(1, epoch=0, loss=2.5, lr=1e-4, loss_scale=65536.0, skipped=False, skipped_total=0,
                grad_norm=torch.tensor(0.75), tokens_per_s=1234.5, time_s=0.1)
        log.log(2, loss=float("nan"), val_loss=2.25, skipped=True, skipped_total=1, mfu=0.31, peak_mem_mb=12.0)
    assert _header(tmp_path / "metrics.csv") == list(METRICS_COLUMNS)
    lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert lines[1] == "1,0,2.5,,0.0001,65536.0,0,0,0.75,1234.5,,,0.1,,"
    rows = read_metrics(tmp_path)
    assert rows[0]["step"] == 1 and isinstance(rows[0]["step"], int)
    assert rows[0]["val_loss"] is None and rows[0]["grad_norm"] == 0.75 and rows[0]["lr"] == 1e-4
    assert math.isnan(rows[1]["loss"]) and rows[1]["skipped"] == 1 and rows[1]["mfu"] == 0.31
    assert rows[1]["epoch"] is None


def test_unknown_metric_key_is_a_value_error_listing_valid_columns(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False)
    with pytest.raises(ValueError, match=r"unknown metrics column 'los' \(did you mean 'loss'\?\); valid: epoch, loss"):
        log.log(1, los=1.0)
    log.close()
    assert read_metrics(tmp_path) == []


def test_rows_survive_sigkill_because_each_row_is_flushed(tmp_path):
    script = textwrap.dedent("""
        import sys, time
        from mixprec.runs.metrics import MetricsLogger
        log = MetricsLogger(sys.argv[1], tensorboard=False)
        for step in range(1, 4):
            log.log(step, loss=1.0 / step)
        log.event({"kind": "skip", "step": 3, "message": "step 3 skipped"})
        print("LOGGED", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "LOGGED"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert read_events(tmp_path)[0]["message"] == "step 3 skipped"


def test_resume_drops_rows_after_the_resumed_step_in_every_file(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        for step in range(1, 7):
            log.log(step, loss=float(step))
            log.log_numerics([{"step": step, "module": "fc", "kind": "act", "absmax": 1.0,
                               "overflow_frac": 0.0, "underflow_frac": 0.0, "dtype": torch.bfloat16}])
            log.event({"step": step, "message": f"event {step}"})
        log.event({"message": "run-level event without a step"})
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=4) as log:
        log.log(5, loss=50.0)
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 50.0)]
    assert [r["step"] for r in read_numerics(tmp_path)] == [1, 2, 3, 4]
    assert read_numerics(tmp_path)[0]["dtype"] == "bfloat16"
    assert [e["message"] for e in read_events(tmp_path)] == [
        "event 1", "event 2", "event 3", "event 4", "run-level event without a step"]
    assert _header(tmp_path / "metrics.csv") == list(METRICS_COLUMNS)


def test_resume_with_a_cut_off_last_row_keeps_the_file_readable(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log(1, loss=1.0)
    with open(tmp_path / "metrics.csv", "a") as f:
        f.write("2,0,1.")  # the process died mid-line
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=1) as log:
        log.log(2, loss=2.0)
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0)]


def test_new_run_starts_files_afresh(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log(1, loss=1.0)
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log(1, loss=9.0)
    assert [r["loss"] for r in read_metrics(tmp_path)] == [9.0]


@dataclass
class Stat:
    step: int
    module: str
    kind: str
    absmax: float
    overflow_frac: float
    underflow_frac: float
    dtype: str


def test_log_numerics_accepts_dicts_and_dataclasses_and_validates(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log_numerics([Stat(1, "blocks.0.mlp", "grad", 3.5e4, 0.01, 0.2, "float16"),
                          {"step": 1, "module": "head", "kind": "update", "absmax": 1e-3}])
        with pytest.raises(ValueError, match="kind must be one of act, grad, update"):
            log.log_numerics([{"step": 1, "module": "x", "kind": "weights"}])
        with pytest.raises(ValueError, match="unknown numerics column"):
            log.log_numerics([{"step": 1, "module": "x", "kind": "act", "max": 1.0}])
    rows = read_numerics(tmp_path)
    assert rows[0] == {"step": 1, "module": "blocks.0.mlp", "kind": "grad", "absmax": 3.5e4,
                       "overflow_frac": 0.01, "underflow_frac": 0.2, "dtype": "float16",
                       "subnormal_frac": None, "loss_scale": None}
    assert rows[1]["overflow_frac"] is None and rows[1]["dtype"] is None


def test_events_need_a_message_and_get_a_time(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        with pytest.raises(ValueError, match="message"):
            log.event({"kind": "overflow", "step": 3})
        log.event({"kind": "overflow", "step": 3, "scale": torch.tensor(32768.0), "module": "blocks.1",
                   "message": "inf in blocks.1 grad; loss scale 65536 -> 32768, step skipped"})
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert len(lines) == 1
    event = json.loads(lines[0])
    assert event["scale"] == 32768.0 and event["kind"] == "overflow" and event["time"] > 0


def test_disabled_logger_writes_nothing_but_still_validates(tmp_path):
    run = tmp_path / "rank1"
    log = MetricsLogger(run, enabled=False)
    log.log(1, loss=1.0)
    log.log_numerics([{"step": 1, "module": "m", "kind": "act"}])
    log.event({"message": "x"})
    with pytest.raises(ValueError):
        log.log(1, bogus=1.0)
    log.close()
    assert not run.exists()


def test_scalars_are_mirrored_to_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path) as log:
        log.log(1, loss=3.0, lr=0.5)
        log.log(2, loss=2.0, val_loss=2.5)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss/train", "loss/val", "train/lr"} <= tags
    assert [(e.step, e.value) for e in acc.Scalars("loss/train")] == [(1, 3.0), (2, 2.0)]


def test_resume_purges_tensorboard_events_after_the_resumed_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path) as log:
        for step in range(1, 6):
            log.log(step, loss=float(step))
    with MetricsLogger(tmp_path, resume_step=3) as log:
        log.log(4, loss=40.0)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss/train")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_resume_purge_holds_whatever_tensorboard_writers_the_process_made_before(tmp_path, monkeypatch):
    """The order dependence: TensorBoard names event files "<second>.<host>.<pid>.<count>", the
    count being process-wide. After 9 earlier writers in one process (other tests' runs), the
    resumed writer's ".10" file sorted before the first run's ".9" within one second, so the
    first run's rows were read after the purge and the rows started at step 4."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.summary.writer import event_file_writer

    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(9))
    with MetricsLogger(tmp_path) as log:                    # this process's 10th writer: ".9"
        for step in range(1, 6):
            log.log(step, loss=float(step))
    with MetricsLogger(tmp_path, resume_step=3) as log:     # ".10"
        log.log(4, loss=40.0)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss/train")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_the_steps_a_row_averages_and_its_evaluation_time_reach_tensorboard_too(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path) as log:
        log.log(10, loss=3.0, steps=10, time_s=1.0)
        log.log(12, loss=2.0, steps=2, time_s=0.2, eval_s=4.0)     # a short row after a resume
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/steps")] == [(10, 10.0), (12, 2.0)]
    assert [(e.step, e.value) for e in acc.Scalars("train/eval_s")] == [(12, 4.0)]
    assert [r["steps"] for r in read_metrics(tmp_path)] == [10, 2]
