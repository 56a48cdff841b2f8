"""What a metrics row says it measured is what it measured: MFU only against an honest peak and
never above 100 %, throughput of training steps only (evaluation apart), and the number of steps
a row averages (a resume from mid-interval logs a short first row, and says so)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import mixprec as mp
from mixprec.policy import hardware, peak
from mixprec.runs.events import RunEvents
from mixprec.runs.metrics import MetricsLogger, read_metrics
from mixprec.strategies import SingleDeviceStrategy
from mixprec.train import meter as meter_mod
from mixprec.train.step import StepOutput

sys.path.insert(0, str(Path(__file__).parent))
from test_resume_lifecycle import QUIET, Regressor, batches  # noqa: E402


def _out(tokens=64):
    return StepOutput(torch.tensor(1.0), None, False, 1.0, tokens)


class FakeClock:
    """``time.perf_counter`` that moves only when told (no sleeps, no timing)."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _meter(tmp_path, precision, monkeypatch, notes=None, load=0.0):
    clock = FakeClock()
    # The fake clock is time.perf_counter for everyone: a peak measured now (no fresh cache
    # entry) would time its GEMMs on it and never end. A cache of the test's own, a fixed GEMM
    # rate and a fixed load: the meter's peak never depends on the machine's cache or load.
    monkeypatch.setenv("MIXPREC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(peak, "matmul_flops", lambda *a, **k: 1e12)
    monkeypatch.setattr(peak, "_load", lambda: load)
    monkeypatch.setattr(meter_mod.time, "perf_counter", clock)
    logger = MetricsLogger(tmp_path, tensorboard=False)
    note = (lambda m: notes.append(m)) if notes is not None else (lambda m: None)
    meter = meter_mod.IntervalMeter(SingleDeviceStrategy(), mp.Precision(precision), Regressor(),
                                    logger, note=note)
    return meter, logger, clock


def test_a_bf16_run_on_a_cpu_that_emulates_bf16_records_no_mfu_and_says_why(tmp_path, monkeypatch,
                                                                           capsys):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    meter, logger, clock = _meter(tmp_path, "bf16-mixed", monkeypatch)
    assert meter.peak is None                     # the emulation's speed is no peak
    meter.add(_out())
    clock.now += 1.0
    meter.log(_out(), step=1, epoch=0, lr=1e-3, val_loss=None)
    logger.close()
    row = read_metrics(tmp_path)[0]
    assert row["mfu"] is None and row["tokens_per_s"] == 64.0
    events = RunEvents(SingleDeviceStrategy(), mp.Precision("bf16-mixed"),
                       MetricsLogger(tmp_path, enabled=False), progress=False)
    events.start(model=Regressor(), step=0, total=1, run_dir=tmp_path)
    assert "MFU not measured: BF16 GEMMs are emulated on this CPU" in capsys.readouterr().err


def test_mfu_above_the_measured_peak_after_a_remeasure_is_not_recorded_and_is_said(tmp_path, monkeypatch):
    monkeypatch.setattr(meter_mod, "format_peak_flops", lambda fmt, device, refresh=False: 1.0)
    notes: list[str] = []
    meter, logger, clock = _meter(tmp_path, "32-true", monkeypatch, notes)
    for step in (1, 2):
        meter.add(_out())
        clock.now += 1.0
        meter.log(_out(), step=step, epoch=0, lr=1e-3, val_loss=None)
    logger.close()
    assert [r["mfu"] for r in read_metrics(tmp_path)] == [None, None]
    assert notes[0].startswith("MFU peak: FP32 1e-09 GFLOP/s, measured at start")   # where it comes from
    assert len(notes) == 2 and "MFU not measured from step 1 on" in notes[1]


def test_evaluation_time_is_kept_out_of_throughput_and_recorded_apart(tmp_path, monkeypatch):
    meter, logger, clock = _meter(tmp_path, "32-true", monkeypatch)
    for _ in range(3):
        meter.add(_out(tokens=100))
        clock.now += 1.0                          # 3 training steps: 3 s
    with meter.evaluating():
        clock.now += 30.0                         # an evaluation: 30 s
    meter.log(_out(), step=3, epoch=0, lr=1e-3, val_loss=2.0)
    meter.add(_out(tokens=100))
    clock.now += 1.0
    meter.log(_out(), step=4, epoch=0, lr=1e-3, val_loss=None)
    logger.close()
    first, second = read_metrics(tmp_path)
    assert first["time_s"] == 3.0 and first["eval_s"] == 30.0 and first["tokens_per_s"] == 100.0
    assert first["steps"] == 3
    assert second["eval_s"] is None and second["time_s"] == 1.0 and second["steps"] == 1


def test_the_first_row_after_a_resume_from_mid_interval_says_it_averages_fewer_steps(tmp_path, capsys):
    run = tmp_path / "run"
    quiet = {**QUIET, "log_interval": 4}
    mp.fit(Regressor(), batches(), max_steps=6, ckpt_interval=6, run_dir=str(run), **quiet)
    mp.fit(Regressor(), batches(), max_steps=8, run_dir=str(run), resume=True, **quiet)
    rows = {r["step"]: r["steps"] for r in read_metrics(run)}
    assert rows == {4: 4, 6: 2, 8: 2}             # 6: the last of the first run; 8: steps 7-8
    err = capsys.readouterr().err
    assert "step 8/8  loss" in err and "(mean of 2 steps)" in err.split("step 8/8")[1].splitlines()[0]


def test_a_plan_with_fp8_layers_is_measured_against_the_fp8_peak_and_gets_no_mfu_where_fp8_is_emulated(tmp_path, capsys):
    """A 32-true base with FP8 per-layer formats (a plan) used the FP32 peak, so its emulated FP8
    layers got an MFU although fp8-tensorwise itself gets none here."""
    import mixprec as mp
    from mixprec.estimate.gpus import peak_kind
    precision = mp.Precision("32-true", overrides={"blocks.*.mlp.*": "fp8-tensorwise"})
    assert precision.layers.peak_format == "fp32"               # before set-up: the mode's own
    precision.setup(mp.models.Transformer.from_preset("tiny"))
    assert precision.layers.peak_format == "fp8" and peak_kind(precision) == "fp8"   # MFU and estimate alike
    from mixprec.policy.peak import no_peak_reason
    assert no_peak_reason("fp8", "cpu") is not None      # this CPU: no honest FP8 peak, no MFU


def test_a_model_without_flops_per_token_is_measured_on_its_matmuls_and_attention(tmp_path, monkeypatch):
    """6 x all parameters counted the embedding look-ups (an HF model's MFU was overstated)."""
    from types import SimpleNamespace

    from torch import nn

    class _Hf(nn.Module):                           # a config like a Hugging Face model's
        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace(num_hidden_layers=2, hidden_size=8)
            self.wte = nn.Embedding(1000, 8)
            self.fc = nn.Linear(8, 8)

    clock = FakeClock()
    monkeypatch.setenv("MIXPREC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(peak, "matmul_flops", lambda *a, **k: 1e12)
    monkeypatch.setattr(peak, "_load", lambda: 0.0)          # a quiet machine: the peak is kept
    monkeypatch.setattr(meter_mod.time, "perf_counter", clock)
    logger = MetricsLogger(tmp_path, tensorboard=False)
    meter = meter_mod.IntervalMeter(SingleDeviceStrategy(), mp.Precision("32-true"), _Hf(), logger)
    meter.add(_out(tokens=32), [(torch.zeros(2, 16, dtype=torch.long), None)])   # 2 x 16 tokens
    clock.now += 1.0
    meter.log(_out(), step=1, epoch=0, lr=1e-3, val_loss=None)
    logger.close()
    assert meter.flops_per_token == 6.0 * (8 * 8 + 8) + 6.0 * 2 * 8 * 16       # not 6 x 8,072
    assert read_metrics(tmp_path)[0]["mfu"] == pytest.approx(32 * meter.flops_per_token / 1e12)


def test_a_peak_measured_on_a_busy_machine_is_no_mfu_peak_and_the_run_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(peak, "_LOW", {})
    monkeypatch.setattr(peak.os, "cpu_count", lambda: 2)
    notes: list[str] = []
    meter, logger, clock = _meter(tmp_path, "32-true", monkeypatch, notes, load=64.0)
    assert meter.peak is None and peak.peak_record(torch.float32, "cpu") is None   # nor cached
    meter.add(_out())
    clock.now += 1.0
    meter.log(_out(), step=1, epoch=0, lr=1e-3, val_loss=None)
    logger.close()
    assert read_metrics(tmp_path)[0]["mfu"] is None
    assert notes == ["MFU not measured: the FP32 peak measured now is not trusted (measured under "
                     "load 64 on 2 cores: likely low); it was not cached"]
