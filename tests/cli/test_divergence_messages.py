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


TRIAL = ["model=tiny", "seq_len=32", "batch_size=4", "progress=false", "audit=false"]
"""The new-user trial's runs (its settings, so its scale history)."""


def _run_recording_warnings(argv, capsys):
    import warnings
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rc = main(argv)
    err = capsys.readouterr().err
    line = next((x for x in err.splitlines() if x.startswith("mixprec: error:")), "")
    return rc, err, line, [w for w in seen if issubclass(w.category, RuntimeWarning)]


def test_a_scale_stuck_at_a_high_min_scale_says_lower_min_scale_once_without_raw_warnings(tmp_path, capsys):
    """``min_scale=1e10`` (loss finite): it said "training diverged ... lower lr", the watch blamed
    the head with layer fixes on every step, each after a raw RuntimeWarning with a file path."""
    rc, err, line, raw = _run_recording_warnings(
        ["train", *TRIAL, "--precision", "16-mixed", "init_scale=1e12", "min_scale=1e10",
         "max_steps=20", f"run_dir={tmp_path / 'r'}"], capsys)
    assert rc == 3, err[-2000:]
    assert "stuck at its floor min_scale=1e+10 while the loss is finite" in line
    assert line.endswith("lower min_scale (e.g. min_scale=1, the default)")
    assert "lower lr" not in line and "diverged" not in line
    assert raw == []                                         # no raw Python warning, any step
    stuck = [x for x in err.splitlines() if "loss scale stuck" in x]
    assert len(stuck) == 1 and "fix: lower min_scale" in stuck[0] and "keep these layers" not in stuck[0]
    assert stuck[0].endswith("(further stuck steps: events.jsonl only)")
    import json
    events = [json.loads(x) for x in (tmp_path / "r" / "events.jsonl").read_text().splitlines() if x.strip()]
    recorded = [e["step"] for e in events if e["kind"] == "stuck-scale"]
    assert len(recorded) > 1 and recorded == sorted(recorded)          # every stuck step, recorded
    assert [e["kind"] for e in events if e.get("kind") in ("diverged", "loss_scale_stuck")] == ["loss_scale_stuck"]


def test_a_scale_that_grew_back_and_overflows_says_raise_growth_interval(tmp_path, capsys):
    """``init_scale=1e7 growth_interval=3``: the scale found its level, grew back to 156250 and
    overflowed at each growth; it said "still backing off from init_scale"."""
    rc, err, line, _ = _run_recording_warnings(
        ["train", *TRIAL, "--precision", "16-mixed", "init_scale=1e7", "growth_interval=3",
         "max_steps=60", f"run_dir={tmp_path / 'r'}"], capsys)
    assert rc == 3, err[-2000:]
    assert "the loss scale doubles after every growth_interval=3 clean steps" in line
    assert line.endswith("raise growth_interval (e.g. growth_interval=2000, the default)")
    assert "backing off" not in line and "lower lr" not in line


def test_each_scaler_setting_is_blamed_only_for_what_it_causes():
    from types import SimpleNamespace

    from mixprec.train.health import RunHealth
    cfg = SimpleNamespace(warmup_steps=0, max_skipped_fraction=0.1, log_interval=10)
    fresh, going = RunHealth(cfg, start_step=0), RunHealth(cfg, start_step=5)
    base = dict(scales_loss=True, init_scale=2.0 ** 16, min_scale=1.0, growth_interval=2000,
                hysteresis=1, loss_finite=True, skipped=20)
    # A floor of 1 is no setting: gradients overflow unscaled (divergence, the caller says so).
    assert fresh.scaler_cause(**base, scale=1.0) is None
    assert "lower min_scale" in fresh.scaler_cause(**{**base, "min_scale": 4.0}, scale=4.0)
    # A short growth interval is blamed only after a step was taken, and only when its own
    # overflows can pass the limit: hysteresis 1 in 3 + 1 > 10 %; 1 in 2000 + 1 is not.
    assert "raise growth_interval" in going.scaler_cause(**{**base, "growth_interval": 3}, scale=512.0)
    assert "still backing off" in fresh.scaler_cause(**{**base, "growth_interval": 3}, scale=512.0)
    assert going.scaler_cause(**{**base, "growth_interval": 9}, scale=2.0 ** 17) is None
    # A non-finite loss, or a mode without loss scaling: none of the scaler's doing.
    assert fresh.scaler_cause(**{**base, "loss_finite": False, "min_scale": 4.0}, scale=4.0) is None
    assert fresh.scaler_cause(**{**base, "scales_loss": False, "min_scale": 4.0}, scale=4.0) is None
