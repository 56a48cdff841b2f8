"""``mixprec bench train`` and ``bench matmul`` end to end on tiny shapes."""
from __future__ import annotations

import csv

import pytest

from mixprec.cli import main
from mixprec.policy.hardware import cpu_has_native_bf16


def test_bench_train_two_modes_two_repeats_writes_csv_and_png(tmp_path, capsys):
    rc = main(["bench", "train", "--model", "tiny", "--modes", "32-true,bf16-mixed", "--batch-size", "2",
               "--seq-len", "16", "--repeats", "2", "--steps", "1", "--warmup", "1", "--threads", "1",
               "--out", str(tmp_path)])
    assert rc == 0
    rows = list(csv.DictReader(open(tmp_path / "bench_train.csv")))
    assert [r["mode"] for r in rows] == ["32-true", "bf16-mixed"]
    for r in rows:
        assert int(r["repeats"]) == 2
        assert float(r["step_ms_min"]) <= float(r["step_ms_median"]) <= float(r["step_ms_max"])
        assert float(r["tokens_per_s"]) > 0
        assert float(r["peak_mem_mb"]) >= 0
    assert 0 < float(rows[0]["mfu"]) <= 1
    # bf16 GEMMs emulated on this CPU: their speed is no peak, so no MFU (a blank cell)
    assert (rows[1]["mfu"] == "") == (not cpu_has_native_bf16())
    assert rows[0]["compute_dtype"] == "fp32" and rows[1]["compute_dtype"] == "bf16"
    assert (tmp_path / "bench_train.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tokens/s" in capsys.readouterr().out


def test_bench_train_rejects_unknown_mode(tmp_path):
    from mixprec.bench.modes import TrainBenchConfig
    from mixprec.errors import ConfigError
    with pytest.raises(ConfigError, match="unknown precision"):
        TrainBenchConfig(modes=("bf61-mixed",))


def test_bench_matmul_smoke(capsys):
    assert main(["bench", "matmul", "--dtypes", "fp32,bf16", "--sizes", "32,64", "--repeats", "1",
                 "--min-time", "0.01", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "GFLOPS" in out and "bf16" in out and "1.00x" in out


def _row(mode: str, ms: float, *, repeats: int, mem: float | None) -> dict:
    # One repeat: min = median = max, and tokens/s * median / 1e3 can round below its own value.
    return {"mode": mode, "tokens_per_s": 2 * 16 / (ms / 1e3) * (1 + 1e-16), "step_ms_median": ms,
            "step_ms_min": ms if repeats == 1 else ms * 0.9, "step_ms_max": ms if repeats == 1 else ms * 1.2,
            "repeats": repeats, "peak_mem_mb": mem}


def test_bench_png_with_one_repeat_draws_no_error_bars_and_says_so(tmp_path):
    from mixprec.bench.modes import bench_figure, write_png
    rows = [_row("32-true", 3.3, repeats=1, mem=10.0), _row("bf16-mixed", 7.7, repeats=1, mem=12.0)]
    fig = bench_figure(rows, "tiny")
    throughput = fig.axes[0]
    assert not throughput.collections and "no error bars" in throughput.get_title()
    write_png(rows, tmp_path / "b.png", "tiny")              # crashed: 'yerr' must not contain negative values
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_png_error_bars_span_min_to_max_and_no_memory_panel_without_memory():
    from mixprec.bench.modes import bench_figure
    rows = [_row("32-true", 10.0, repeats=3, mem=None)]
    fig = bench_figure(rows, "tiny")
    assert len(fig.axes) == 1                                  # --no-memory: no empty panel
    (bars,) = fig.axes[0].collections                          # the error bar LineCollection
    (segment,) = bars.get_segments()
    tokens = 2 * 16
    assert segment[:, 1].min() == pytest.approx(tokens / 0.012)
    assert segment[:, 1].max() == pytest.approx(tokens / 0.009)
