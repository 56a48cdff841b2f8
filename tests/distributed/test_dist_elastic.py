"""Elastic runs on loopback: `torchrun --max-restarts` after a worker is SIGKILLed restarts the
group, and `mixprec train resume=auto` continues from the newest complete checkpoint to the same
final weights, bit for bit, as an uninterrupted run; a worker that hangs ends the run within
MIXPREC_DIST_TIMEOUT with a line naming the ranks. The test kills/freezes worker PIDs itself:
nothing in the library knows about it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dist_harness import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from gated import GatedRun  # noqa: E402

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
DIST_TIMEOUT_S = 8


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text((REPO / "README.md").read_text() * 4)
    return path


def _settings(corpus: Path, run: Path, max_steps: int) -> list[str]:
    return ["model=tiny", f"data={corpus}", "seq_len=32", "batch_size=4", f"max_steps={max_steps}",
            "ckpt_interval=2", "log_interval=1", "eval_interval=0", "eval_batches=2",
            "progress=false", "audit=false", "strategy=ddp", "warmup_steps=2",
            f"run_dir={run}", "resume=auto"]


def _torchrun(*extra: str, settings: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
           "MIXPREC_DIST_TIMEOUT": str(DIST_TIMEOUT_S)}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node=2", *extra, "-m", "mixprec", "train", *settings],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _wait_for(predicate, limit: float, what: str) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _steps_logged(run: Path) -> int:
    try:
        return len((run / "metrics.csv").read_text().splitlines()) - 1
    except OSError:
        return 0


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    latest = (run / "checkpoints" / "latest").read_text().strip()
    return load_file(str(run / "checkpoints" / latest / "model.safetensors"))


def test_sigkilled_worker_is_restarted_and_resumes_to_identical_weights(tmp_path, corpus):
    run = tmp_path / "elastic"
    # Rank 1 of the first attempt stops before step 5 (checkpoints at 2 and 4 are complete) and
    # says so; it is killed there, by the event, so the run can neither end first nor race on.
    job = GatedRun("step:5@1", *_settings(corpus, run, 8), env={"MIXPREC_DIST_TIMEOUT": "120"},
                   launcher=("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "--max-restarts=2"))
    try:
        line = job.wait_for("GATE step:5")
        os.kill(int(line.split("pid=")[1]), signal.SIGKILL)
        code, out = job.finish()
    finally:
        job.kill()
    assert code == 0, out[-3000:]
    assert "continuing from the newest checkpoint" in out          # resume=auto took over
    assert out.count("[mixprec] done: 8 steps") == 1

    straight = tmp_path / "straight"
    ref = _torchrun(settings=_settings(corpus, straight, 8))
    _, ref_err = ref.communicate(timeout=150)
    assert ref.returncode == 0, ref_err[-3000:]
    got, want = _weights(run), _weights(straight)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_hung_worker_ends_the_run_within_the_timeout_naming_the_ranks(tmp_path, corpus):
    run = tmp_path / "hang"
    proc = _torchrun(settings=_settings(corpus, run, 400))
    try:
        _wait_for(lambda: _steps_logged(run) >= 2 or proc.poll() is not None, 120, "step 2")
        workers = _children(proc.pid)
        assert len(workers) == 2 and proc.poll() is None
        os.kill(workers[-1], signal.SIGSTOP)                   # frozen: never reaches the collective
        frozen_at = time.monotonic()
        _, err = proc.communicate(timeout=DIST_TIMEOUT_S + 90)
        ended_after = time.monotonic() - frozen_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    lines = [ln for ln in err.splitlines() if ln.startswith("mixprec: error: ")]
    assert len(lines) == 1, err[-3000:]
    assert "crashed, hung or lost the network" in lines[0]
    assert f"waited at most {DIST_TIMEOUT_S} s" in lines[0]
    assert lines[0].startswith("mixprec: error: rank 0: ") and "(rank 1)" in lines[0] or \
        lines[0].startswith("mixprec: error: rank 1: ") and "(rank 0)" in lines[0]
    # the timeout, plus torchrun's grace period for the frozen worker (SIGTERM, then SIGKILL)
    assert DIST_TIMEOUT_S * 0.9 <= ended_after < DIST_TIMEOUT_S + 60

