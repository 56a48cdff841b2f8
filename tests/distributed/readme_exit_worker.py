"""One rank of the README's "The library" example under torchrun, recording how it ended.

    torchrun --nproc-per-node=2 readme_exit_worker.py SCRIPT OUT_DIR

Runs ``SCRIPT`` (the README block, written out by the test) as ``__main__``, exactly as
``torchrun ... SCRIPT`` would. Before it, registers an exit hook; hooks run last-registered
first, so this one runs after every hook the script and mixprec registered, right before
interpreter shutdown. It writes ``OUT_DIR/rank<R>.json``: whether the process group was still
initialised there and how many DDP wrappers were still alive (either is left to shutdown, where
gloo can abort the process).
"""
from __future__ import annotations

import atexit
import json
import os
import runpy
import sys


def _record(out_dir: str) -> None:
    import gc

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    gc.collect()
    alive = sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"initialized_at_exit": dist.is_initialized(), "ddp_alive_at_exit": alive}, f)


if __name__ == "__main__":
    script, out_dir = sys.argv[1], sys.argv[2]
    atexit.register(_record, out_dir)
    sys.argv = [script]
    runpy.run_path(script, run_name="__main__")
