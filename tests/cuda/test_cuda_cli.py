"""The two commands a user types first, on a GPU: ``mixprec train`` (the default model on the
built-in corpus, a few steps) writes a run folder with throughput and MFU, and ``mixprec report``
turns it into a page."""
from __future__ import annotations

import pytest

from mixprec.cli.main import main
from mixprec.runs.metrics import read_metrics

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp8-tensorwise"])
def test_train_then_report_on_the_gpu(precision, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", f"precision={precision}", "max_steps=30", "log_interval=10",
                 "eval_interval=0", "progress=false", f"run_dir={run}"]) == 0
    err = capsys.readouterr().err
    assert "device: cuda" in err and "[mixprec] done: 30 steps" in err
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [10, 20, 30]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert all(r["mfu"] is None or 0 < r["mfu"] <= 1 for r in rows)
    assert main(["report", str(run)]) == 0
    assert (run / "report" / "report.html").is_file() and (run / "report" / "loss.png").is_file()
