"""``mixprec plan`` writes a plan that ``mixprec train --precision plan:PATH`` trains with."""
import json

from mixprec.cli import main


def test_plan_command_writes_a_plan_that_train_uses(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["plan", "model=tiny", "batch_size=2", "seq_len=32", "--batches", "1",
                 "--candidates", "bf16,fp8-tensorwise", "--target", "H100", "-o", str(plan)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "chosen" in out and "plan:" in out
    assert "[mixprec] trade-off: predicted" in captured.err and "faster Linear GEMMs" in captured.err
    data = json.loads(plan.read_text())
    assert data["measured_calibration"] <= data["budget"]        # (1 batch: none held out)
    assert data["measured_heldout"] is None and "measured" in out
    formats = dict(data["overrides"])
    assert set(formats) >= {"blocks.0.attn.qkv", "head"} and data["precision"]
    assert (tmp_path / "plan.png").is_file()
    run = tmp_path / "run"
    assert main(["train", "--precision", f"plan:{plan}", "model=tiny", "batch_size=2", "seq_len=32",
                 "max_steps=2", "eval_interval=0", "eval_batches=1", f"run_dir={run}",
                 "progress=false"]) == 0
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert next(e for e in events if e["kind"] == "formats")["layers"] == formats
