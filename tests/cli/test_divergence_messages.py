"""A loss scale still backing off from a too-large init_scale is not reported as divergence, and
"pick a safer precision" is not suggested under 32-true."""
import pytest

from mixprec.cli.main import main

TINY = ["model=tiny", "seq_len=16", "batch_size=2", "log_interval=1", "eval_interval=0", "eval_batches=1",
        "progress=false", "audit=false", "trace_nonfinite=false", "warmup_steps=0"]


def test_too_large_init_scale_says_lower_init_scale_not_lower_lr(tmp_path, capsys):
    rc = main(["train", *TINY, "--precision", "16-mixed", "init_scale=1e30", "max_steps=30",
               f"run_dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err
    assert rc == 3, err[-2000:]
    line = next(line for line in err.splitlines() if line.startswith("mixprec: error:"))
    assert "still backing off from init_scale=1e+30" in line and "lower init_scale" in line
    assert "lower lr" not in line and "diverged" not in line
    # recorded and plotted as what it is, not as "diverged" (events.jsonl said kind "diverged")
    import json
    from mixprec.report.figures import _marks
    from mixprec.runs.read import run_progress
    events = [json.loads(x) for x in (tmp_path / "r" / "events.jsonl").read_text().splitlines() if x.strip()]
    (end,) = [e for e in events if e.get("kind") in ("diverged", "loss_scale_stuck")]
    assert end["kind"] == "loss_scale_stuck"
    assert [label for _, label, _ in _marks(events)] == ["stopped: loss scale stuck"]
    assert run_progress({"max_steps": 30}, events, 1).endswith("(stopped: loss scale stuck)")


def test_old_runs_diverged_events_still_read_as_diverged():
    from mixprec.report.figures import _marks
    from mixprec.runs.read import run_progress
    old = [{"kind": "diverged", "step": 12, "message": "training stopped at step 12: ..."}]
    assert [label for _, label, _ in _marks(old)] == ["diverged"]
    assert run_progress({"max_steps": 30}, old, 10) == "12 of 30 (diverged)"


def test_real_divergence_under_32_true_does_not_suggest_a_safer_precision(tmp_path, capsys):
    rc = main(["train", *TINY, "--precision", "32-true", "lr=1e12", "clip_grad_norm=none", "max_steps=40",
               f"run_dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err
    assert rc == 3, err[-2000:]
    line = next(line for line in err.splitlines() if line.startswith("mixprec: error:"))
    assert "training diverged" in line and "lower lr" in line and "safer precision" not in line


def test_the_suggested_init_scale_is_never_above_the_default():
    """Stopped while backing off from init_scale=1e30, the message suggested init_scale=9.53674e+23,
    which fails again when followed."""
    from mixprec.train.health import RunHealth as Guard
    message = Guard.backing_off_message(init_scale=1e30, scale=9.53674e23, skipped=20)
    assert message.endswith("(e.g. init_scale=65536)")
    assert Guard.backing_off_message(init_scale=2.0 ** 20, scale=512.0, skipped=11).endswith(
        "(e.g. init_scale=512)")
