"""One rank of `mixprec train` under torchrun that also records what was alive at teardown.

    torchrun --nproc-per-node=2 exit_worker.py OUT_DIR KEY=VALUE...

Runs ``mixprec.cli.main(["train", ...])`` exactly as ``python -m mixprec train`` does, with
``torch.distributed.destroy_process_group`` wrapped (test side, no hook in the library) to count
the DDP/FSDP wrappers still alive when the group is destroyed: a wrapper holds the process group,
and a group that outlives ``destroy_process_group`` is torn down during interpreter shutdown,
where gloo can abort or hang the process. Writes ``OUT_DIR/rank<R>.json``, then exits with the
command's status.
"""
from __future__ import annotations

import gc
import json
import os
import sys

import torch.distributed as dist


def _alive_wrappers() -> int:
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel
    gc.collect()
    return sum(isinstance(o, (DistributedDataParallel, FSDPModule)) for o in gc.get_objects())


def main(out_dir: str, settings: list[str]) -> int:
    seen: dict[str, int] = {}
    original = dist.destroy_process_group

    def recording_destroy(*args, **kwargs):
        seen["wrappers_alive_at_destroy"] = _alive_wrappers()
        return original(*args, **kwargs)

    dist.destroy_process_group = recording_destroy
    from mixprec.cli import main as mixprec_main
    code = mixprec_main(["train", *settings])
    rank = os.environ.get("RANK", "0")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"code": code, **seen}, f)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
