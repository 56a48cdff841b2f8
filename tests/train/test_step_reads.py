"""Host reads of a training step in steady state (issue #35): counted on a CPU between log
intervals. A read is an ``.item()`` (``_local_scalar_dense``) or a ``.tolist()``; torch's own
reads of its CPU step counters (``_get_value``, a host tensor, no device sync) are not counted.

``fit()`` learns step t's outcome (taken or skipped) just before step t + 1's update
(``Trainer.conclude``): the one read of a steady step is the *previous* step's flag copy, made
before that step's update was queued, read after this step's forward and backward were queued."""
from __future__ import annotations

import collections
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec.precision.plugins.params as precision_mod
from mixprec.amp import host_flags
from mixprec.optim.inputs import takes_found_inf
from mixprec.precision import Precision
from mixprec.train.trainer import Trainer

from tests.train.test_trainer_step import Regressor, batches


class _Reads(TorchDispatchMode):
    """Counts reads per step (the step ``train_step`` is taking), and records, in order, each
    step's backward calls, the steps whose flag copies it read, and its update."""

    def __init__(self, trainer_cls) -> None:
        super().__init__()
        self.by_step: collections.Counter[int] = collections.Counter()
        self.device_reads: collections.Counter[int] = collections.Counter()
        self.where: dict[int, list[str]] = collections.defaultdict(list)
        self.timeline: dict[int, list[tuple[str, int | None]]] = collections.defaultdict(list)
        self.made_in: dict[int, tuple[object, int]] = {}   # id(copy) -> (copy, step it was made in)
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
        me = self
        self._saved = (torch.Tensor.tolist, self.cls.train_step, host_flags._HostCopy.__init__,
                       host_flags._read_host_copies, Precision.backward, Precision.step)
        tolist, train_step, copy_init, read_copies, backward, step = self._saved

        def counted_tolist(t):
            me._read()
            return tolist(t)

        def numbered_train_step(trainer, *a, **k):
            me.step = trainer.step + 1
            return train_step(trainer, *a, **k)

        def noted_copy_init(copy, flag):
            copy_init(copy, flag)
            me.made_in[id(copy)] = (copy, me.step)

        def noted_read(copies):
            for c in copies:
                me.timeline[me.step].append(("read", me.made_in[id(c)][1]))
            return read_copies(copies)

        def noted_backward(precision, loss, **k):
            me.timeline[me.step].append(("backward", None))
            return backward(precision, loss, **k)

        def noted_step(precision, optimizer, **k):
            me.timeline[me.step].append(("update", None))
            return step(precision, optimizer, **k)
        torch.Tensor.tolist, self.cls.train_step = counted_tolist, numbered_train_step
        host_flags._HostCopy.__init__, host_flags._read_host_copies = noted_copy_init, noted_read
        Precision.backward, Precision.step = noted_backward, noted_step
        return super().__enter__()

    def __exit__(self, *a):
        (torch.Tensor.tolist, self.cls.train_step, host_flags._HostCopy.__init__,
         host_flags._read_host_copies, Precision.backward, Precision.step) = self._saved
        return super().__exit__(*a)


def _reads_per_step(tmp_path, mode: str, device: str = "cpu", fused: bool = False, **kw):
    torch.manual_seed(0)
    log = 5
    trainer = Trainer(Regressor(), run_dir=str(tmp_path / mode), mixed_precision=mode, max_steps=13,
                      log_interval=log, progress=False, audit=False, ckpt_interval=0,
                      warmup_steps=2, clip_grad_norm=None, **kw)
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
def test_a_steady_step_reads_only_the_previous_steps_flag_copy_after_its_own_backward(tmp_path, mode, fused):
    # The one read of a steady step is of step t-1's flag copy (issued before step t-1's update):
    # after step t's backward, before step t's update, so on a GPU it waits for nothing queued
    # since. The loss scale and the counters come with it (16-mixed: no second read). A step
    # right after a log interval reads nothing: its predecessor concluded at the log. With
    # torch's fused AdamW (fit()'s on CUDA) the skip is the fused kernel's, on the device.
    per_step, reads, trainer = _reads_per_step(tmp_path, mode, fused=fused)
    assert takes_found_inf(trainer.optimizer.inner) is fused
    assert trainer.outcome_lags
    where = {s: reads.where[s] for s in per_step}
    assert per_step == {s: 0 if s in (6, 11) else 1 for s in per_step}, (per_step, where)
    assert sum(reads.device_reads[s] for s in per_step) == 0, where
    for s in per_step:
        line = reads.timeline[s]
        kinds = [k for k, _ in line]
        assert kinds[-1] == "update" and kinds.count("update") == 1, (s, line)
        read_at = [i for i, (k, _) in enumerate(line) if k == "read"]
        assert [line[i][1] for i in read_at] == ([] if s in (6, 11) else [s - 1]), (s, line)
        assert all(i > kinds.index("backward") for i in read_at), (s, line)


@pytest.mark.parametrize("mode", ["bf16-true", "16-mixed"])
def test_settling_each_step_reads_the_steps_own_flag_right_after_it(tmp_path, mode):
    # What the lag moved: with settle_each_step (or a hook that needs the outcome at once) a step
    # reads its own flag's copy after its update, as fit() did before.
    torch.manual_seed(0)
    trainer = Trainer(Regressor(), run_dir=str(tmp_path / mode), mixed_precision=mode, max_steps=4,
                      log_interval=5, progress=False, audit=False, ckpt_interval=0,
                      warmup_steps=2, clip_grad_norm=None)
    trainer.settle_each_step = True
    assert not trainer.outcome_lags
    with _Reads(Trainer) as reads:
        trainer.fit(batches(4))
    for s in (2, 3):    # (a read after train_step returned still counts for the step it took)
        assert reads.timeline[s] == [("backward", None), ("update", None), ("read", s)], reads.timeline[s]
        assert reads.by_step[s] == 1 and reads.device_reads[s] == 0, reads.where[s]
