"""`torchrun --nproc_per_node=2 -m mixprec train` on CPU (gloo): the README's launch line works,
rank 0 alone reports and writes, and the run resumes from its checkpoint under torchrun too."""
import csv
import os
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
           "-m", "mixprec", "train", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_torchrun_two_processes_train_and_resume(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(Path(__file__).resolve().parents[2].joinpath("README.md").read_text()
                              for _ in range(4)))
    run = tmp_path / "run"
    common = ["model=tiny", f"data={corpus}", "seq_len=32", "batch_size=4", "log_interval=1",
              "eval_interval=0", "eval_batches=2", "ckpt_interval=2", "progress=false", "audit=false",
              f"run_dir={run}"]
    proc = torchrun(*common, "max_steps=4")
    assert proc.stderr.count("[mixprec] done: 4 steps") == 1          # rank 0 alone reports
    assert "x 2 (MirroredStrategy)" in proc.stderr
    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]              # one writer, no duplicates
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000004"

    # The printed hint is the command for this launch: torchrun with the same number of ranks.
    hint = next(l for l in proc.stderr.splitlines() if l.startswith("[mixprec] resume:"))
    words = shlex.split(hint.split(":", 1)[1].split("  (")[0])
    assert words == ["torchrun", "--nproc_per_node=2", "-m", "mixprec", "train", "--resume", str(run),
                     "max_steps=8"]
    proc = torchrun(*words[5:])             # as printed (on a free rendezvous port)
    assert proc.stderr.count("[mixprec] done: 8 steps") == 1
    with open(run / "metrics.csv", newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [1, 2, 3, 4, 5, 6, 7, 8]


def test_torchrun_fsdp_bf16_mixed_trains_and_saves_full_weights(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(Path(__file__).resolve().parents[2].joinpath("README.md").read_text() * 4)
    run = tmp_path / "run"
    proc = torchrun("model=tiny", f"data={corpus}", "seq_len=32", "batch_size=4", "max_steps=2",
                    "log_interval=1", "eval_interval=0", "eval_batches=2", "progress=false",
                    "audit=false", "strategy=fsdp", "--precision", "bf16-mixed", f"run_dir={run}")
    assert "x 2 (FSDPStrategy)" in proc.stderr
    from safetensors.torch import load_file
    weights = load_file(str(run / "checkpoints" / "step-00000002" / "model.safetensors"))
    # Full (unsharded) FP32 tensors: the FP32 shards are the master weights under FSDP2.
    assert weights["blocks.0.attn.qkv.weight"].shape == (192, 64)
    assert all(t.dtype == torch.float32 for t in weights.values())


def _sigint_job(tmp_path: Path, run: Path, step: int, launcher: str, *, while_waiting=None):
    """A 2-rank `mixprec train` under ``launcher`` (``torch.distributed.run`` or ``mixprec.launch``)
    that both ranks hold before ``step``; then SIGINT to the launcher, as timeout/Ctrl-C do, and
    the ranks go on to save. ``while_waiting(pids)`` runs while both ranks wait at the gate.
    Returns (exit code, everything printed)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
    from gated import GatedRun
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(Path(__file__).resolve().parents[2].joinpath("README.md").read_text() * 4)
    job = GatedRun(f"step:{step}", "model=tiny", f"data={corpus}", "seq_len=32", "batch_size=4",
                   "max_steps=1000", "ckpt_interval=0", "log_interval=1", "eval_interval=0",
                   "progress=false", "audit=false", f"run_dir={run}",
                   launcher=("-m", launcher, "--nnodes=1", "--nproc_per_node=2",
                             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}"))
    try:
        pids = {job.wait_for(f"GATE step:{step}").split("pid=")[1].strip() for _ in range(2)}
        if while_waiting is not None:
            while_waiting(pids)
        job.signal(signal.SIGINT)
        job.wait_for("finishing this step and saving a checkpoint")
        job.release()
        job.release()
        return job.finish()
    finally:
        job.kill()


def test_sigint_to_torchrun_saves_on_every_rank_and_says_how_to_resume_under_torchrun(tmp_path):
    """What `timeout -s INT torchrun ...` does: torchrun alone gets the signal (its workers run in
    sessions of their own) and forwards it; the workers save, exit 130, and rank 0 prints the
    torchrun resume command and the one line about torchrun's own traceback. While it trains, one
    rank holds the run folder's lock."""
    run = tmp_path / "my run"

    def lock_is_held_by_a_rank(pids):
        # Both ranks wait before step 3; one of them (rank 0) holds the run folder's lock.
        from mixprec.errors import ConfigError
        from mixprec.runs.lock import RunLock
        with pytest.raises(ConfigError, match="is in use by pid") as held:
            RunLock.acquire(run)
        assert str(held.value).split("in use by pid ")[1].split()[0] in pids

    code, out = _sigint_job(tmp_path, run, 3, "torch.distributed.run", while_waiting=lock_is_held_by_a_rank)
    assert code != 0, out[-3000:]                   # torchrun's own status (1): see docs/distributed.md
    hint = shlex.join(["torchrun", "--nproc_per_node=2", "-m", "mixprec", "train", "--resume", str(run)])
    assert f"mixprec: stopped by SIGINT at step 3; checkpoint saved in " in out
    assert f"continue with: {hint}" in out, out[-3000:]
    assert "mixprec: every rank saved and exits 130; torchrun's own report may follow" in out
    assert (run / "checkpoints" / "step-00000003" / "meta.json").is_file()


def test_mixprec_launch_stopped_by_sigint_exits_130_in_one_line_with_its_own_resume_hint(tmp_path):
    """`python -m mixprec.launch` is torchrun (same arguments, torch's launcher code) whose ending
    says what happened: after the workers saved it exits 130 with one line, where plain torchrun
    prints a SignalException traceback and exits 1 (the test above)."""
    run = tmp_path / "run"
    code, out = _sigint_job(tmp_path, run, 2, "mixprec.launch")
    assert code == 130, out[-3000:]
    assert "Traceback" not in out and "SignalException" not in out, out[-3000:]
    assert "mixprec.launch: stopped by SIGINT" in out
    hint = shlex.join(["python", "-m", "mixprec.launch", "--nproc_per_node=2", "-m", "mixprec",
                       "train", "--resume", str(run)])
    assert f"continue with: {hint}" in out, out[-3000:]
    assert "torchrun's own report may follow" not in out
    assert (run / "checkpoints" / "step-00000002" / "meta.json").is_file()


def test_mixprec_launch_exits_with_the_failed_workers_status_without_a_traceback(tmp_path):
    """A worker that exits 3 (a diverged run's status): plain torchrun says ChildFailedError with a
    traceback and exits 1; mixprec.launch gives one line and 3."""
    script = tmp_path / "worker.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "mixprec.launch", "--nnodes=1", "--nproc_per_node=2",
                           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", str(script)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "mixprec.launch: " in proc.stderr and "rank 1: exit 3" in proc.stderr, proc.stderr[-3000:]
