"""On a GPU, a steady step of fit() makes no device sync (issue #35): the skip flag is read from
its host copy (issued before the update), the loss scale moves on the device. Counted on a CPU in
tests/train/test_step_reads.py."""
from __future__ import annotations

import pytest
import torch

from mixprec.train.trainer import Trainer

from tests.train.test_trainer_step import Regressor, batches

pytestmark = pytest.mark.cuda


# bf16-mixed / 32-true: fit()'s AdamW is torch's fused one there, skipping on the device.
@pytest.mark.parametrize("mode", ["bf16-true", "16-mixed", "bf16-mixed", "32-true"])
def test_on_cuda_a_steady_step_makes_no_device_sync(tmp_path, mode):
    torch.manual_seed(0)
    trainer = Trainer(Regressor(), run_dir=str(tmp_path / mode), mixed_precision=mode,
                      max_steps=9, log_interval=5, progress=False, audit=False, ckpt_interval=0,
                      warmup_steps=2, clip_grad_norm=None)
    synced: list[int] = []
    step_of = Trainer.train_step

    def train_step(tr, micro):
        steady = tr.step + 1 in (2, 3, 4, 7, 8)
        torch.cuda.set_sync_debug_mode("error" if steady else "default")
        try:
            return step_of(tr, micro)
        except RuntimeError as e:              # a sync in a steady step
            synced.append(tr.step + 1)
            raise AssertionError(f"step {tr.step + 1} synced: {e}") from None
        finally:
            torch.cuda.set_sync_debug_mode("default")
    Trainer.train_step = train_step
    try:
        trainer.fit(batches(9))
    finally:
        Trainer.train_step = step_of
    assert not synced
