"""Two gloo ranks: an overflow on one rank makes every rank skip and back off together."""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mixprec.amp import GradScaler


def _worker(rank: int, world: int, init_file: str, result_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        p = torch.nn.Parameter(torch.ones(4))
        opt = torch.optim.SGD([p], lr=0.5)
        scaler = GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
        log = []
        for step in range(4):
            opt.zero_grad()
            scaler.scale(p.sum()).backward()
            if step == 1 and rank == 1:            # only rank 1 sees the overflow
                p.grad[2] = math.inf
            scaler.step(opt)
            scaler.update()
            log.append((scaler.get_scale(), scaler.last_step_skipped, p.detach().tolist()))
        torch.save(log, f"{result_file}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_found_inf_is_max_reduced_so_all_ranks_skip_together(tmp_path):
    init_file, result_file = str(tmp_path / "init"), str(tmp_path / "log")
    # fork: the children inherit the imported torch instead of paying for a fresh import each
    mp.start_processes(_worker, args=(2, init_file, result_file), nprocs=2, join=True,
                       start_method="fork")
    logs = [torch.load(f"{result_file}.{r}", weights_only=True) for r in range(2)]
    assert logs[0] == logs[1]
    scales, skipped, params = zip(*logs[0])
    assert scales == (256.0, 128.0, 128.0, 256.0)
    assert skipped == (False, True, False, False)
    assert params[1] == params[0] and params[2] != params[1]
