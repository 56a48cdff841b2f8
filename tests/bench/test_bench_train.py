"""``mixprec bench train`` and ``bench matmul`` end to end on tiny shapes."""
from __future__ import annotations

import csv

import pytest

from mixprec.cli import main


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
        assert float(r["tokens_per_s"]) > 0 and float(r["mfu"]) > 0
        assert float(r["peak_mem_mb"]) >= 0
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
