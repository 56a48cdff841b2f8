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


def test_a_refresh_keeps_the_higher_fresh_value_and_a_busy_measurement_says_so(fake, monkeypatch):
    fake["values"] = [1.0e9] * 3
    peak.peak_flops(torch.float32, "cpu")
    fake["values"] = [0.5e9] * 3                  # measured again on a busier machine
    assert peak.peak_flops(torch.float32, "cpu", refresh=True) == 1.0e9 and fake["calls"] == 6
    monkeypatch.setattr(peak, "_load", lambda: 64.0)
    monkeypatch.setattr(peak.os, "cpu_count", lambda: 2)
    fake["values"] = [1.5e9] * 3
    assert peak.peak_flops(torch.float32, "cpu", refresh=True) == 1.5e9
    assert "load 64 on 2 cores then: likely low" in peak.format_peak_source("fp32", "cpu")


def test_peaks_measured_at_every_start_say_so():
    assert peak.format_peak_source("fp8", "cpu") == "measured at start, not cached"


def test_estimate_on_the_cpu_says_where_its_peak_comes_from(fake, capsys):
    from mixprec.cli.main import main
    fake["values"] = [1.0e9] * 3
    assert main(["estimate", "--gpu", "cpu", "--tokens", "1M", "--model", "tiny",
                 "--precision", "32-true"]) == 0
    assert "FP32 peak of this CPU: measured 2026-11-30 00:53 UTC (0 min ago)" in capsys.readouterr().out
