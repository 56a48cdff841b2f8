"""A rank that dies or hangs ends the job with a clear error within the timeout; training then
resumes from the last checkpoint and ends where an uninterrupted run ends (2-process gloo jobs)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from dist_harness import free_port, torchrun_env
import rank_failure_worker as worker

pytestmark = pytest.mark.distributed

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_failure_worker.py")
TIMEOUT_S = 5


def launch(mode: str, ckpt: str, out: str) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(worker.WORLD):
        env = {**os.environ, **torchrun_env(rank, worker.WORLD, port), "TEST_TIMEOUT": str(TIMEOUT_S)}
        procs.append(subprocess.Popen([sys.executable, WORKER, mode, ckpt, f"{out}.{rank}"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def finish(proc: subprocess.Popen, limit: float) -> tuple[int | None, str]:
    try:
        _, err = proc.communicate(timeout=limit)
        return proc.returncode, err
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        return None, err


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    """Start the kill and hang jobs together; wait for rank 0 of each, then clean up rank 1."""
    dirs = {m: tmp_path_factory.mktemp(m) for m in ("kill", "hang")}
    jobs = {m: launch(m, str(d), str(d / "out")) for m, d in dirs.items()}
    out = {}
    for mode, (rank0, rank1) in jobs.items():
        code, err = finish(rank0, 120)
        out[mode] = {"code": code, "err": err, "dir": dirs[mode]}
        if rank1.poll() is None:
            rank1.kill()
        rank1.communicate()
    return out


@pytest.mark.parametrize("mode", ["kill", "hang"])
def test_lost_rank_ends_the_job_with_a_clear_error(failures, mode):
    r = failures[mode]
    assert r["code"] == 3, r["err"][-2000:]
    lines = [ln for ln in r["err"].splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, r["err"][-2000:]
    assert "another rank (rank 1) crashed, hung or lost the network" in lines[0]
    assert "resume from the last checkpoint" in lines[0]
    # the failing step ended within the process-group timeout (slack for a loaded machine)
    waited = float(next(ln for ln in r["err"].splitlines() if ln.startswith("waited_s="))[9:])
    assert waited < 4 * TIMEOUT_S
    if mode == "hang":   # nothing told rank 0: only the timeout can have ended the wait
        assert waited >= 0.9 * TIMEOUT_S


def test_training_resumes_from_the_last_checkpoint(failures):
    ckpt = failures["kill"]["dir"]
    assert torch.load(ckpt / "last.pt", weights_only=True)["step"] == worker.FAIL_AT
    procs = launch("resume", str(ckpt), str(ckpt / "resumed"))
    for p in procs:
        code, err = finish(p, 120)
        assert code == 0, err[-2000:]
    results = [torch.load(f"{ckpt}/resumed.{r}", weights_only=True) for r in range(worker.WORLD)]
    assert results[0]["start"] == worker.FAIL_AT
    # uninterrupted reference: one process, whole global batch per step
    x, y = worker.make_data()
    model = worker.make_model()
    opt = worker.make_optimizer(model.parameters())
    per = worker.LOCAL_B * worker.WORLD
    for step in range(worker.STEPS):
        nn.functional.mse_loss(model(x[step * per:(step + 1) * per]), y[step * per:(step + 1) * per]).backward()
        opt.step()
        opt.zero_grad()
    for r in results:
        for got, want in zip(r["params"], model.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
