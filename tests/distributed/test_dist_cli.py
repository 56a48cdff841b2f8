"""`torchrun --nproc_per_node=2 -m mixprec train` on CPU (gloo): the README's launch line works,
rank 0 alone reports and writes, and the run resumes from its checkpoint under torchrun too."""
import csv
import os
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

    proc = torchrun("--resume", str(run), "max_steps=6")
    assert proc.stderr.count("[mixprec] done: 6 steps") == 1
    with open(run / "metrics.csv", newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [1, 2, 3, 4, 5, 6]


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
