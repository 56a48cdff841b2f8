"""One real 2-process gloo run: ranks found through torch.distributed get disjoint, covering shards."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mixprec.data import DistributedDataLoader, write_token_file

pytestmark = pytest.mark.distributed


def test_two_gloo_ranks_see_disjoint_samples_covering_the_epoch(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    job = Path(__file__).with_name("_gloo_loader_job.py")
    write_token_file(tmp_path / "data.tokens", np.arange(401), vocab_size=401)
    procs = [subprocess.Popen([sys.executable, str(job), str(tmp_path), str(rank)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    result = json.loads((tmp_path / "result.json").read_text())
    r0, r1 = result["ranks"]
    assert (r0["rank"], r0["world"], r1["rank"], r1["world"]) == (0, 2, 1, 2)
    n = result["num_samples"]
    assert n == 100
    for epoch in range(2):
        a, b = r0["epochs"][epoch], r1["epochs"][epoch]
        assert not set(a) & set(b) and len(a) == len(b) == len(set(a))
        assert len(a) + len(b) == 2 * 3 * (n // 6)                       # 96 of 100: whole batches on both
        assert set(a) | set(b) <= set(range(n))
    assert r0["epochs"][0] != r0["epochs"][1]                          # reshuffled per epoch
    assert result["steps_sum"] == 2 * (n // 6)
    # the real run and ranks simulated in one process agree exactly
    for rank, got in ((0, r0), (1, r1)):
        sim = DistributedDataLoader(_Ids(n), batch_size=3, seed=7, rank=rank, world_size=2)
        for epoch in range(2):
            sim.set_epoch(epoch)
            assert [int(v) for x, _ in sim for v in x[:, 0]] == got["epochs"][epoch]


class _Ids(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor([i]), torch.tensor([i + 1])
