"""Two "nodes" on loopback: two separate `torchrun --nnodes=2 --nproc-per-node=1` launches meet at
one c10d rendezvous endpoint and train as one job (gloo). The result is the same job as one node
with two processes: one run folder, written by global rank 0, and the same final weights."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_harness import free_port

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
LIMIT_S = 150          # generous: two cores shared with other jobs; a hang is a failure, not a wait


def _train_args(corpus: Path, run: Path, strategy: str) -> list[str]:
    return ["-m", "mixprec", "train", "model=tiny", f"data={corpus}", "seq_len=32", "batch_size=4",
            "max_steps=3", "log_interval=1", "eval_interval=0", "eval_batches=2", "progress=false",
            "audit=false", f"strategy={strategy}", "precision=bf16-mixed", f"run_dir={run}"]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "MIXPREC_DIST_TIMEOUT": "60"}


def _torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run"]


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    latest = (run / "checkpoints" / "latest").read_text().strip()
    return load_file(str(run / "checkpoints" / latest / "model.safetensors"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text((REPO / "README.md").read_text() * 4)
    return path


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_nodes_one_process_each_equal_one_node_two_processes(tmp_path, corpus, strategy):
    multi = tmp_path / "two-nodes"
    port = free_port()
    nodes = [subprocess.Popen(
        [*_torchrun(), "--nnodes=2", f"--node-rank={r}", "--nproc-per-node=1",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=mixprec-test",
         "--local-addr=127.0.0.1", *_train_args(corpus, multi, strategy)],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    errs = []
    try:
        for node in nodes:
            _, err = node.communicate(timeout=LIMIT_S)
            errs.append(err)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, err in zip(nodes, errs):
        assert node.returncode == 0, err[-3000:]
    both = "".join(errs)
    assert both.count("[mixprec] done: 3 steps") == 1                 # global rank 0 alone reports
    assert "x 2 (" in both                                             # one job of world size 2
    assert f"--rdzv-endpoint=127.0.0.1:{port} --rdzv-id=mixprec-test -m mixprec train --resume" in both
    assert [p.name for p in tmp_path.iterdir()] == ["two-nodes"]      # one run folder
    rows = (multi / "metrics.csv").read_text().splitlines()[1:]
    assert [int(r.split(",")[0]) for r in rows] == [1, 2, 3]           # one writer

    single = tmp_path / "one-node"
    proc = subprocess.run([*_torchrun(), "--standalone", "--nproc-per-node=2",
                           *_train_args(corpus, single, strategy)],
                          env=_env(), capture_output=True, text=True, timeout=LIMIT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = _final_weights(multi), _final_weights(single)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
