"""One rank of a small DDP job that checkpoints every step; rank 1 can be made to die or hang.

    python rank_failure_worker.py MODE CKPT_DIR OUT_FILE      (RANK, WORLD_SIZE, ... in the env)

MODE: ``kill`` (rank 1 SIGKILLs itself at step FAIL_AT), ``hang`` (rank 1 stops responding
there), ``resume`` (every rank restarts from the checkpoint and finishes). Rank 0 writes a
checkpoint after every step, the way a trainer does. A rank whose peer is lost prints the
one-line ``RankFailureError`` and exits with status 3, as the ``mixprec`` command line does.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import torch
from torch import nn

STEPS, FAIL_AT, LOCAL_B, WORLD = 6, 3, 8, 2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def make_data():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(STEPS * LOCAL_B * WORLD, 8, generator=g)
    return x, x[:, :1] * 0.5 - x[:, 1:2]


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def main(mode: str, ckpt_dir: str, out_file: str) -> int:
    from mixprec.strategies import MirroredStrategy, RankFailureError

    torch.set_num_threads(1)
    strategy = MirroredStrategy(timeout=float(os.environ.get("TEST_TIMEOUT", "5")))
    model, opt = strategy.setup(make_model(), make_optimizer)
    x, y = make_data()
    path = os.path.join(ckpt_dir, "last.pt")
    start = 0
    if mode == "resume":
        state = torch.load(path, weights_only=True) if strategy.is_main else None
        strategy.load_model_state_dict(model, state and state["model"])
        strategy.load_optimizer_state_dict(model, opt, state and state["optim"])
        start = int(strategy.reduce_max(state["step"] if state else 0))
    step_started = time.monotonic()
    try:
        for step in range(start, STEPS):
            step_started = time.monotonic()
            if strategy.rank == 1 and step == FAIL_AT and mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if strategy.rank == 1 and step == FAIL_AT and mode == "hang":
                time.sleep(600)
            rows = slice((step * WORLD + strategy.rank) * LOCAL_B, (step * WORLD + strategy.rank + 1) * LOCAL_B)
            with strategy.guard():
                nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
                opt.step()
                opt.zero_grad()
                state = {"model": strategy.model_state_dict(model),
                         "optim": strategy.optimizer_state_dict(model, opt), "step": step + 1}
            if strategy.is_main:
                torch.save(state, path + ".tmp")
                os.replace(path + ".tmp", path)   # a crash never leaves half a checkpoint
    except RankFailureError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        print(f"waited_s={time.monotonic() - step_started:.2f}", file=sys.stderr, flush=True)
        os._exit(3)   # skip destroy_process_group: the peer is gone
    torch.save({"params": [p.detach() for p in model.parameters()], "start": start}, out_file)
    strategy.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
