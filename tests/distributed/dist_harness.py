"""Run a function in N real processes joined by a gloo process group, the way torchrun would.

Each child gets ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` (a free
port), one intra-op thread (the CI machine has two cores), and returns a picklable result that
the parent collects. A child that raises fails the whole job with its traceback.
"""
from __future__ import annotations

import os
import socket
import tempfile

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _child(rank: int, fn, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ.update(torchrun_env(rank, world_size, port))
    os.environ.setdefault("MIXPREC_DIST_TIMEOUT", "60")
    torch.set_num_threads(1)
    result = fn(rank, *args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    del result
    import gc

    import torch.distributed as dist
    if dist.is_initialized():
        # As Strategy.teardown does: free the DDP/FSDP modules fn left in reference cycles (they
        # hold the group), meet, then destroy. A group still referenced at interpreter exit is
        # torn down during finalization, where gloo can abort the process (SIGABRT, seen once in
        # test_dist_fsdp.py's fixture).
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def run_distributed(fn, *args, world_size: int = 2) -> list:
    """``[fn(0, *args), ..., fn(world_size-1, *args)]``, each run in its own process."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_child, args=(fn, world_size, free_port(), out_dir, args), nprocs=world_size,
                 join=True)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                for r in range(world_size)]
