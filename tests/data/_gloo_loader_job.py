"""Two real processes on gloo, each building a DistributedDataLoader from torch.distributed's rank.

Run by tests/data/test_data_distributed.py as two processes, ``python _gloo_loader_job.py WORKDIR
RANK``, over the token file ``WORKDIR/data.tokens``; rank 0 writes ``WORKDIR/result.json`` with each
rank's sample ids for two epochs and the batch counts.
"""
import json
import sys

import torch
import torch.distributed as dist


def _worker(rank: int, workdir: str) -> None:
    from mixprec.data import DistributedDataLoader, TokenDataset

    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=2)
    try:
        ds = TokenDataset(f"{workdir}/data.tokens", max_length=4)
        loader = DistributedDataLoader(ds, batch_size=3, seed=7)  # rank/world from torch.distributed
        epochs = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            # window i starts at token 4*i, and token t has id t, so inputs[:, 0] // 4 is the sample index
            epochs.append([int(v) // 4 for x, _ in loader for v in x[:, 0]])
        steps = torch.tensor([len(loader)])
        dist.all_reduce(steps)  # a collective: fails if the group is broken
        gathered = [None, None]
        dist.all_gather_object(gathered, {"rank": loader.rank, "world": loader.world_size, "epochs": epochs})
        if rank == 0:
            with open(f"{workdir}/result.json", "w") as f:
                json.dump({"ranks": gathered, "steps_sum": int(steps.item()), "num_samples": len(ds)}, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _worker(int(sys.argv[2]), sys.argv[1])
