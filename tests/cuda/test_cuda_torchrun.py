"""``mixprec train`` under ``torchrun --nproc-per-node=1`` on a GPU with ``strategy=ddp`` and
``strategy=fsdp``: the job trains on ``cuda:LOCAL_RANK`` and finishes cleanly.

One process is a one-device job for mixprec (``WORLD_SIZE=1``: no process group, no DDP/FSDP2
wrapping, as docs/distributed.md says), so this checks the launch, the device choice and the
teardown under torchrun on a GPU; NCCL collectives need two GPUs (the gloo tests in
tests/distributed cover the collectives' logic on CPU)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_one_process_torchrun_job_trains_on_the_gpu(strategy, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((REPO / "README.md").read_text() * 4)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
           f"--master-port={_free_port()}", "-m", "mixprec", "train", "model=tiny", f"data={corpus}",
           "seq_len=64", "batch_size=8", "max_steps=5", "log_interval=1", "eval_interval=0",
           "eval_batches=2", "progress=false", "audit=false", f"strategy={strategy}",
           "precision=bf16-mixed", f"run_dir={run}"]
    proc = subprocess.run(cmd, env={**os.environ, "MIXPREC_DIST_TIMEOUT": "60"}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "device: cuda" in proc.stderr and "[mixprec] done: 5 steps" in proc.stderr
    assert (run / "metrics.csv").is_file() and (run / "checkpoints" / "latest").is_file()
