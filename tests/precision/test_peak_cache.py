"""The cached CPU matmul peak (MFU's denominator) says when and how it was measured and is
measured again when it is too old: it was kept forever, even when measured under load, and was
re-measured only when an MFU passed 100 %. A fake clock and a fake GEMM timer: no timing."""
from __future__ import annotations

import json

import pytest
import torch

from mixprec.policy import peak

T0 = 1_796_000_000.0          # 2026-11-30 00:53 UTC


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A cache folder of its own, a clock the test moves, and a GEMM 'timer' returning the next
    of the values the test queues (counting the measurements)."""
    monkeypatch.setenv("MIXPREC_CACHE", str(tmp_path))
    state = {"now": T0, "values": [], "calls": 0}
    monkeypatch.setattr(peak, "_now", lambda: state["now"])
    monkeypatch.setattr(peak, "_load", lambda: 0.5)

    def timed(dtype, device, *, n, min_time, warmup=2):
        state["calls"] += 1
        return state["values"].pop(0)        # 1e9 FLOP/s: n=256 is already "big enough"
    monkeypatch.setattr(peak, "matmul_flops", timed)
    return state


def test_a_measured_peak_records_when_its_runs_spread_and_the_load(fake):
    fake["values"] = [1.0e9, 0.8e9, 0.9e9]
    assert peak.peak_flops(torch.float32, "cpu") == 1.0e9 and fake["calls"] == 3
    rec = peak.peak_record(torch.float32, "cpu")
    assert rec["measured_at"] == T0 and rec["runs"] == [1.0e9, 0.8e9, 0.9e9]
    assert rec["spread"] == pytest.approx(0.2) and rec["load"] == 0.5
    assert rec["torch"] == torch.__version__ and rec["threads"] == torch.get_num_threads()
    fake["now"] = T0 + 3 * 3600
    said = peak.format_peak_source("fp32", "cpu")
    assert said.startswith("measured 2026-11-30 00:53 UTC ") and "(3.0 h ago), best of 3 runs 20 % apart" in said
    assert "cached in" in said and "for 7 days" in said


def test_a_cached_peak_is_used_within_its_age_and_measured_again_after(fake):
    fake["values"] = [1.0e9] * 3
    peak.peak_flops(torch.float32, "cpu")
    fake["now"] = T0 + peak.MAX_AGE_S - 1
    assert peak.peak_flops(torch.float32, "cpu") == 1.0e9 and fake["calls"] == 3     # cached
    fake["now"] = T0 + peak.MAX_AGE_S + 1
    fake["values"] = [0.7e9] * 3                  # a fresh measurement replaces a stale one
    assert peak.peak_flops(torch.float32, "cpu") == 0.7e9 and fake["calls"] == 6
    assert peak.peak_record(torch.float32, "cpu")["measured_at"] == T0 + peak.MAX_AGE_S + 1


def test_undated_and_future_dated_entries_are_measured_again(fake, tmp_path):
    key = peak._cache_key(torch.float32, torch.device("cpu"))
    old = json.dumps({key: 5.0e9})
    (tmp_path / "peak_flops.json").write_text(old)       # an older mixprec's cache: bare numbers
    (tmp_path / peak.CACHE_FILE).write_text(old)
    fake["values"] = [1.0e9] * 3
    assert peak.peak_flops(torch.float32, "cpu") == 1.0e9 and fake["calls"] == 3
    # The older version's file is left as it was: that version reads every entry as a number.
    assert (tmp_path / "peak_flops.json").read_text() == old
    data = json.loads((tmp_path / peak.CACHE_FILE).read_text())
    data[key]["measured_at"] = T0 + 86400                                 # a clock that went back
    (tmp_path / peak.CACHE_FILE).write_text(json.dumps(data))
    fake["values"] = [1.1e9] * 3
    assert peak.peak_flops(torch.float32, "cpu") == 1.1e9 and fake["calls"] == 6


def test_a_refresh_keeps_the_higher_fresh_value(fake):
    fake["values"] = [1.0e9] * 3
    peak.peak_flops(torch.float32, "cpu")
    fake["values"] = [0.5e9] * 3                  # measured again on a busier machine
    assert peak.peak_flops(torch.float32, "cpu", refresh=True) == 1.0e9 and fake["calls"] == 6


def test_a_measurement_under_load_is_measured_again_and_never_cached_nor_an_mfu_peak(fake, monkeypatch):
    # It was cached and only described as "likely low": every run for a week took MFU against it.
    monkeypatch.setattr(peak, "_LOW", {})
    monkeypatch.setattr(peak, "_load", lambda: 64.0)
    monkeypatch.setattr(peak.os, "cpu_count", lambda: 2)
    fake["values"] = [0.3e9] * 3 + [0.4e9] * 3    # three runs, then three more: still busy
    assert peak.peak_flops(torch.float32, "cpu") == 0.4e9 and fake["calls"] == 6
    assert peak.peak_record(torch.float32, "cpu") is None                     # not cached
    assert "load 64 on 2 cores: likely low" in peak.low_peak_reason("fp32", "cpu")
    fake["values"] = [0.4e9] * 6
    assert peak.format_peak_flops("fp32", "cpu") is None                      # no MFU against it
    monkeypatch.setattr(peak, "_load", lambda: 0.5)                           # the machine quietens
    fake["values"] = [1.0e9] * 3
    assert peak.format_peak_flops("fp32", "cpu") == 1.0e9 and peak.low_peak_reason("fp32", "cpu") is None
    assert peak.peak_record(torch.float32, "cpu")["flops"] == 1.0e9


def test_a_gpu_peak_far_below_its_datasheet_is_not_kept_saying_so(fake, monkeypatch):
    # The first H200 run cached 155 TF for FP16 measured while the GPU was busy (datasheet: 989).
    monkeypatch.setattr(peak, "_LOW", {})
    monkeypatch.setattr(peak.torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(peak.torch.cuda, "synchronize", lambda device=None: None)
    gpu = torch.device("cuda", 0)
    why = peak._why_low(155e12, "fp16", gpu, 0.5)
    assert why.startswith("155 TFLOP/s is 16% of the H200 datasheet's dense FP16 989.5 TFLOP/s")
    assert peak._why_low(794e12, "bf16", gpu, 0.5) is None                    # a healthy H200
    assert peak._why_low(1e12, "bf16", torch.device("cpu"), 0.5) is None      # no datasheet for CPUs
    tf32 = iter([150e12] * 3 + [160e12] * 3)                                   # 32 % of 494.5: low
    monkeypatch.setattr(peak, "time_matmul", lambda *a: next(tf32))
    assert peak.format_peak_flops("tf32", gpu) is None
    assert "H200 datasheet's dense TF32 494.5" in peak.low_peak_reason("tf32", gpu)
    seen = iter([420e12] * 3)
    monkeypatch.setattr(peak, "time_matmul", lambda *a: next(seen))
    assert peak.format_peak_flops("tf32", gpu) == 420e12 and peak.low_peak_reason("tf32", gpu) is None


def test_peaks_measured_at_every_start_say_so():
    assert peak.format_peak_source("fp8", "cpu") == "measured at start, not cached"


def test_estimate_on_the_cpu_says_where_its_peak_comes_from(fake, capsys):
    from mixprec.cli.main import main
    fake["values"] = [1.0e9] * 3
    assert main(["estimate", "--gpu", "cpu", "--tokens", "1M", "--model", "tiny",
                 "--precision", "32-true"]) == 0
    assert "FP32 peak of this CPU: measured 2026-11-30 00:53 UTC (0 min ago)" in capsys.readouterr().out


def test_a_low_refresh_keeps_the_cached_peak_as_the_mfu_peak(fake, monkeypatch):
    monkeypatch.setattr(peak, "_LOW", {})
    fake["values"] = [1.0e9] * 3
    peak.peak_flops(torch.float32, "cpu")                                     # quiet: cached
    monkeypatch.setattr(peak, "_load", lambda: 64.0)
    monkeypatch.setattr(peak.os, "cpu_count", lambda: 2)
    fake["values"] = [0.5e9] * 6                                              # busy, twice
    assert peak.format_peak_flops("fp32", "cpu", refresh=True) == 1.0e9       # the cached one
    assert peak.low_peak_reason("fp32", "cpu") is None


@pytest.mark.parametrize("label", ["fp8", "fp4", "tf32", "bf16", "fp16", "fp32"])
def test_every_peak_format_label_can_be_asked_why_it_is_low(label):
    """A run whose narrowest format is a micro format (``fp4``: mxfp4 / nvfp4 layers) asked for the
    reason with a label no dtype parses, and fit() ended in 'unknown dtype fp4'."""
    assert peak.low_peak_reason(label, "cpu") is None or isinstance(peak.low_peak_reason(label, "cpu"), str)
