"""`mixprec audit` runs its probes the way training runs them, and `--resume RUN` audits that run."""
from pathlib import Path

import pytest

from mixprec.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "examples" / "configs" / "hf-llama-tiny.json"
SMALL = ["seq_len=16", "batch_size=2"]


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_audit_of_a_hugging_face_model_in_16_bit_true_modes_does_not_crash(precision, capsys):
    pytest.importorskip("transformers")
    rc = main(["audit", f"model=hf:{LLAMA}", "--precision", precision, *SMALL])
    out = capsys.readouterr()
    assert rc == 0, out.err[-2000:]
    assert "Traceback" not in out.err and f"precision: {precision}" in out.out


def test_audit_resume_audits_the_runs_model_and_weights(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "model=tiny", *SMALL, "max_steps=2", "eval_interval=0", "eval_batches=1",
                 "progress=false", "audit=false", f"run_dir={run}"]) == 0
    capsys.readouterr()
    files = sorted(p.relative_to(run) for p in run.rglob("*"))
    assert main(["audit", "--resume", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"run: {run}" in out and "model tiny" in out
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == files     # nothing written
