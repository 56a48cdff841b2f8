"""One rank of a script that calls ``mixprec.fit()`` under torchrun, recording the process group.

    torchrun --nproc-per-node=2 fit_exit_worker.py OUT_DIR CORPUS STRATEGY [user-group]

``STRATEGY`` is passed to ``fit()`` by name. With ``user-group`` the script creates the process
group itself first. Writes ``OUT_DIR/rank<R>.json``: whether the group is still initialized
after ``fit()`` returned, and how many DDP/FSDP wrappers were alive when it was destroyed.
"""
from __future__ import annotations

import gc
import json
import os
import sys

import torch.distributed as dist


def main(out_dir: str, corpus: str, strategy: str, user_group: bool) -> int:
    from torch.nn.parallel import DistributedDataParallel

    import mixprec as mp
    seen: dict[str, int] = {}
    original = dist.destroy_process_group

    def recording_destroy(*args, **kwargs):
        gc.collect()
        seen["wrappers_alive_at_destroy"] = sum(isinstance(o, DistributedDataParallel)
                                                for o in gc.get_objects())
        return original(*args, **kwargs)

    dist.destroy_process_group = recording_destroy
    if user_group:
        dist.init_process_group("gloo")
    model = mp.models.Transformer.from_preset("tiny", max_seq_len=16)
    loader = mp.data.DistributedDataLoader(mp.data.TokenDataset(corpus, max_length=16), batch_size=2)
    result = mp.fit(model, loader, strategy=strategy, max_steps=2, progress=False, audit=False,
                    run_dir=os.path.join(out_dir, "run"), ckpt_interval=0)
    rank = int(os.environ["RANK"])
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"steps": result.steps, "initialized_after_fit": dist.is_initialized(), **seen}, f)
    if user_group:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:] == ["user-group"]))
