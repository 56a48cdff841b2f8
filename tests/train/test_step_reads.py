"""Host reads of a training step in steady state (issue #35): counted on a CPU between log
intervals. A read is an ``.item()`` (``_local_scalar_dense``) or a ``.tolist()``; torch's own
reads of its CPU step counters (``_get_value``, a host tensor, no device sync) are not counted."""
from __future__ import annotations

import collections
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec.precision.precision as precision_mod
from mixprec.optim.inputs import takes_found_inf
from mixprec.train.trainer import Trainer

from tests.train.test_trainer_step import Regressor, batches


class _Reads(TorchDispatchMode):
    def __init__(self, trainer_cls) -> None:
        super().__init__()
        self.by_step: collections.Counter[int] = collections.Counter()
        self.device_reads: collections.Counter[int] = collections.Counter()
        self.where: dict[int, list[str]] = collections.defaultdict(list)
        self.step = 0
        self.cls = trainer_cls

    def _read(self) -> None:
        stack = traceback.format_stack(limit=14)
        if any("_get_value" in f for f in stack):
            return                         # torch's CPU step counter, not a device read
        self.by_step[self.step] += 1
        if not any("_read_host_copies" in f for f in stack):
            self.device_reads[self.step] += 1      # not of a flag's copy issued before the update
        self.where[self.step].append("".join(f for f in stack[-8:-2] if "mixprec" in f))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "_local_scalar_dense":
            self._read()
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._tolist, self._train_step = torch.Tensor.tolist, self.cls.train_step
        me = self

        def tolist(t):
            me._read()
            return me._tolist(t)

        def train_step(trainer, *a, **k):
            me.step = trainer.step + 1
            return me._train_step(trainer, *a, **k)
        torch.Tensor.tolist, self.cls.train_step = tolist, train_step
        return super().__enter__()

    def __exit__(self, *a):
        torch.Tensor.tolist, self.cls.train_step = self._tolist, self._train_step
        return super().__exit__(*a)


def _reads_per_step(tmp_path, mode: str, device: str = "cpu", fused: bool = False):
    torch.manual_seed(0)
    log = 5
    trainer = Trainer(Regressor(), run_dir=str(tmp_path / mode), mixed_precision=mode, max_steps=13,
                      log_interval=log, progress=False, audit=False, ckpt_interval=0,
                      warmup_steps=2, clip_grad_norm=None)
    with pytest.MonkeyPatch.context() as m:
        if fused:        # fit()'s AdamW on CUDA: torch's fused one (forced here on a CPU)
            m.setattr(precision_mod, "_fuses", lambda *a: True)
        with _Reads(Trainer) as reads:
            trainer.fit(batches(13))
    steady = [s for s in range(2, 13) if s % log]          # not the first, not a logged step
    return {s: reads.by_step[s] for s in steady}, reads, trainer


@pytest.mark.parametrize("mode,fused", [("bf16-true", False), ("16-mixed", False), ("bf16-mixed", False),
                                        ("16-mixed", True), ("bf16-mixed", True), ("32-true", True)],
                         ids=["bf16-true", "16-mixed", "bf16-mixed", "16-mixed-fused", "bf16-mixed-fused",
                              "32-true-fused"])
def test_a_step_between_log_intervals_reads_one_host_copy_and_syncs_nothing(tmp_path, mode, fused):
    # A step's one read (the skip, for the LR schedule and the skip's trace) is of the flag's
    # host copy, issued before the update was queued: on a GPU it waits for the flag, not for the
    # update. The loss scale and the counters come with it (16-mixed: no second read). With
    # torch's fused AdamW (fit()'s on CUDA) the skip is the fused kernel's, on the device.
    per_step, reads, trainer = _reads_per_step(tmp_path, mode, fused=fused)
    assert takes_found_inf(trainer.optimizer.inner) is fused
    assert max(per_step.values()) <= 1, (per_step, {s: reads.where[s] for s in per_step})
    assert sum(reads.device_reads[s] for s in per_step) == 0, \
        {s: reads.where[s] for s in per_step if reads.device_reads[s]}
