"""`mixprec train` end to end: exact resume after SIGKILL, config precedence, bad input, golden curve."""
import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from gated import GatedRun  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "tiny_fp32_loss.json"
TINY = ["model=tiny", "seq_len=32", "batch_size=4", "log_interval=1", "eval_interval=0",
        "eval_batches=2", "warmup_steps=3", "lr=3e-3", "progress=false", "audit=false"]


def mixprec(*args, check=True, timeout=300, **kw):
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "mixprec", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"mixprec {' '.join(map(str, args))} failed:\n{proc.stderr[-3000:]}")
    return proc


def losses(run_dir: Path) -> dict[int, str]:
    """step -> the loss exactly as written (full repr), to compare bit for bit."""
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(r["step"]): r["loss"] for r in csv.DictReader(f)}


def test_sigkill_and_resume_reproduces_the_losses_bit_for_bit(tmp_path, text_corpus):
    common = [*TINY, f"data={text_corpus}", "max_steps=14", "ckpt_interval=4", "keep_last=2"]
    mixprec("train", *common, f"run_dir={tmp_path / 'straight'}")
    reference = losses(tmp_path / "straight")
    assert sorted(reference) == list(range(1, 15))

    killed = tmp_path / "killed"
    run = GatedRun("step:7", *common, f"run_dir={killed}")
    run.wait_for("GATE step:7")     # 6 steps done (a checkpoint at 4), the 7th about to start
    run.signal(signal.SIGKILL)
    run.finish()
    assert max(losses(killed)) == 6
    mixprec("train", "--resume", killed)
    assert losses(killed) == reference


def test_settings_precedence_command_line_over_file_over_defaults(tmp_path, text_corpus):
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'max_steps = 3\nlr = 0.5\n[data_section]\ndata = "{text_corpus}"\n')
    proc = mixprec("train", "--config", cfg, *TINY, "max_steps=2", f"run_dir={tmp_path / 'r'}")
    assert "max_steps = 2  (command line)" in proc.stderr
    assert "lr = 0.003  (command line)" in proc.stderr
    saved = (tmp_path / "r" / "config.toml").read_text()
    assert "max_steps = 2" in saved and "lr = 0.003" in saved and str(text_corpus) in saved


@pytest.mark.parametrize("args, message", [
    (["lrr=0.1"], "unknown setting 'lrr' (command line) (did you mean 'lr'?)"),
    (["max_steps=ten"], "max_steps expects an integer, got 'ten'"),
    (["batch_size=0"], "batch_size must be > 0"),
    (["--precision", "bf61"], "unknown precision 'bf61' (did you mean 'bf16'?)"),
    (["data=/nonexistent/tokens.bin"], "/nonexistent/tokens.bin"),
])
def test_bad_settings_give_one_line_and_exit_2(args, message):
    proc = mixprec("train", *args, check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("mixprec: error:")]
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_resume_rejects_a_truncated_checkpoint_and_keeps_the_files(tmp_path, text_corpus):
    run = tmp_path / "r"
    mixprec("train", *TINY, f"data={text_corpus}", "max_steps=4", "ckpt_interval=2",
            f"run_dir={run}")
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    weights = latest / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    proc = mixprec("train", "--resume", run, "max_steps=6", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "model.safetensors" in proc.stderr
    assert weights.stat().st_size == len(data) // 2          # nothing deleted or rewritten
    assert (run / "checkpoints" / "step-00000002").is_dir()  # the earlier checkpoint is intact


def test_resume_rejects_a_checkpoint_of_another_model(tmp_path, text_corpus):
    run = tmp_path / "r"
    mixprec("train", *TINY, f"data={text_corpus}", "max_steps=2", f"run_dir={run}")
    proc = mixprec("train", "--resume", run, "d_model=32", "max_steps=3", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "does not fit this model" in proc.stderr


def test_tiny_run_follows_the_golden_loss_curve(tmp_path, text_corpus):
    """A 30-step FP32 run on fixed text; 2% per-step tolerance absorbs BLAS differences between
    machines but not a changed step (a wrong LR schedule, scaler or data order moves it more)."""
    run = tmp_path / "g"
    mixprec("train", *TINY, f"data={text_corpus}", "max_steps=30", "precision=32-true",
            f"run_dir={run}")
    got = {k: float(v) for k, v in losses(run).items()}
    if os.environ.get("MIXPREC_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps({"command": "tests/train/test_train_cli.py", "loss": got}, indent=1))
    golden = {int(k): v for k, v in json.loads(GOLDEN.read_text())["loss"].items()}
    assert sorted(got) == sorted(golden)
    for step, value in golden.items():
        assert got[step] == pytest.approx(value, rel=0.02), f"step {step}"
    assert golden[30] < golden[1] - 1.0  # the curve the test guards actually learns


def test_resume_auto_starts_fresh_in_an_empty_folder_then_continues_from_its_checkpoint(
        tmp_path, text_corpus):
    common = [*TINY, f"data={text_corpus}", "ckpt_interval=2"]
    mixprec("train", *common, "max_steps=4", f"run_dir={tmp_path / 'straight'}")
    run = tmp_path / "auto"
    run.mkdir()                                           # present but empty: a fresh start
    proc = mixprec("train", *common, "max_steps=2", "resume=auto", f"run_dir={run}")
    assert "no complete checkpoint" in proc.stderr and "starting fresh" in proc.stderr
    # the same command again (what a restarted job does) continues from step 2
    proc = mixprec("train", *common, "max_steps=4", "resume=auto", f"run_dir={run}")
    assert "continuing from the newest checkpoint" in proc.stderr
    assert "steps: 2 -> 4" in proc.stderr
    assert losses(run) == losses(tmp_path / "straight")


def test_resume_auto_without_run_dir_is_one_line_error():
    proc = mixprec("train", "resume=auto", "model=tiny", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("mixprec: error:")]
    assert len(lines) == 1 and "resume=auto needs an explicit run_dir" in lines[0]
