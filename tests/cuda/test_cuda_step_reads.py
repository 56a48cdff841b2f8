"""On a GPU, a steady step of fit() makes no device sync (issue #35): the previous step's skip
flag is read from its host copy (issued before that step's update) just before this step's update
(``Trainer.conclude``), the loss scale moves on the device. Counted on a CPU in
tests/train/test_step_reads.py."""
from __future__ import annotations

import pytest
import torch

from mixprec.train.trainer import Trainer

from tests.train.test_trainer_step import Regressor, batches

pytestmark = pytest.mark.cuda

_STEADY = (2, 3, 4, 7, 8)
"""Not the first step, not a logged one (5, 9), nor the rest of a logged step's loop iteration."""


# bf16-mixed / 32-true: fit()'s AdamW is torch's fused one there, skipping on the device.
@pytest.mark.parametrize("mode", ["bf16-true", "16-mixed", "bf16-mixed", "32-true"])
def test_on_cuda_a_steady_step_of_fit_makes_no_device_sync(tmp_path, mode):
    torch.manual_seed(0)
    trainer = Trainer(Regressor(), run_dir=str(tmp_path / mode), mixed_precision=mode,
                      max_steps=9, log_interval=5, progress=False, audit=False, ckpt_interval=0,
                      warmup_steps=2, clip_grad_norm=None)
    step_of = Trainer.train_step
    steps: list[int] = []

    def train_step(tr, micro):
        # "error" from a steady step's start to the next step's: its forward and backward, the
        # previous step's conclusion, its update, and the loop's bookkeeping after it.
        steps.append(tr.step + 1)
        torch.cuda.set_sync_debug_mode("error" if tr.step + 1 in _STEADY else "default")
        return step_of(tr, micro)
    Trainer.train_step = train_step
    try:
        trainer.fit(batches(9))       # a sync in a steady step raises RuntimeError here
    finally:
        Trainer.train_step = step_of
        torch.cuda.set_sync_debug_mode("default")
    assert trainer.outcome_lags and steps == list(range(1, 10))
