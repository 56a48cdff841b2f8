"""The loss scale on the device (issue #35): ``update()`` after an optimizer stepped on the device
reads nothing on the host; the host state read lazily is exactly the eager one's."""
from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec.amp.grad_scaler import GradScaler
from mixprec.errors import NumericsError


class Reads(TorchDispatchMode):
    """Host reads: ``.item()`` (``_local_scalar_dense``) and ``.tolist()`` (not an aten op)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        reads = self

        def tolist(t):
            reads.n += 1
            return reads._tolist(t)
        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *a):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*a)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket.__name__ == "_local_scalar_dense"
        return func(*args, **(kwargs or {}))


def _run(overflows, lazy, **kw):
    """One parameter, one optimizer; ``lazy``: the optimizer 'skips on the device'."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = GradScaler("cpu", **kw)
    scales, reads = [], 0
    for bad in overflows:
        loss = (p * (float("inf") if bad else 1.0)).sum()
        scaler.scale(loss).backward()
        with Reads() as r:
            if lazy:
                scaler.found_inf(opt)
                opt.step()                       # (SGD with lr 0: nothing moves either way)
                scaler.stepped_on_device(opt)
            else:
                scaler.step(opt)
            scaler.update()
            t = scaler._tensors_for(torch.device("cpu"))[0].clone()
        reads += r.n
        scales.append(t)
        opt.zero_grad()
    return scaler, [float(s) for s in scales], reads


@pytest.mark.parametrize("kw", [
    {},
    {"init_scale": 8.0, "growth_interval": 3, "hysteresis": 2, "backoff_factor": 0.3,
     "growth_factor": 1.7, "min_scale": 1.0, "max_scale": 100.0, "on_min_scale": "warn"},
    {"init_scale": 2.0 ** 20, "growth_interval": 2, "max_scale": 2.0 ** 22},
], ids=["torch-defaults", "hysteresis-odd-factors-bounds", "growth-to-max"])
def test_the_scale_moved_on_the_device_is_the_hosts_exactly(kw):
    rnd = random.Random(0)
    overflows = [rnd.random() < 0.35 for _ in range(60)]
    with pytest.warns(RuntimeWarning) if kw.get("on_min_scale") == "warn" else _nothing():
        lazy, lazy_scales, lazy_reads = _run(overflows, True, **kw)
        assert lazy_reads == 0 and lazy.pending == len(overflows)
        eager, eager_scales, _ = _run(overflows, False, **kw)
        assert lazy_scales == eager_scales          # the scale each step multiplied the loss by
        assert lazy.state_dict() == eager.state_dict()     # a read of everything queued
    assert lazy.pending == 0
    assert (lazy.num_skipped_steps, lazy.num_overflows, lazy.last_step_skipped, lazy.get_scale()) == \
        (eager.num_skipped_steps, eager.num_overflows, eager.last_step_skipped, eager.get_scale())
    assert lazy.num_skipped_steps == sum(overflows)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_a_stuck_scale_raises_at_the_lazy_read_not_at_the_step():
    # Documented lag: the device keeps skipping; the error comes when the host reads the queue.
    scaler, _, reads = _run([True] * 4, True, init_scale=2.0, min_scale=1.0, on_min_scale="raise")
    assert reads == 0
    with pytest.raises(NumericsError, match="stuck at min_scale"):
        scaler.get_scale()
    assert scaler.pending == 0 and scaler.num_skipped_steps == 4


def test_the_queue_is_read_every_max_pending_iterations(monkeypatch):
    monkeypatch.setattr(GradScaler, "_MAX_PENDING", 5)
    scaler, _, reads = _run([False] * 12, True)
    assert reads == 2 and scaler.pending == 2


def test_counters_of_an_open_iteration_read_lazily():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = GradScaler("cpu")
    scaler.scale((p * float("nan")).sum()).backward()
    scaler.found_inf(opt)
    scaler.stepped_on_device(opt)
    assert scaler.last_step_skipped and scaler.num_skipped_steps == 1   # before update()
    scaler.update()
    assert scaler.num_skipped_steps == 1 and scaler.num_overflows == 1
    assert scaler.get_scale() == 2.0 ** 15
