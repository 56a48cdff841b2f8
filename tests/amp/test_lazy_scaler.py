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


def _run(overflows, lazy, *, reconfigure=None, **kw):
    """One parameter, one optimizer; ``lazy``: the optimizer 'skips on the device'.
    ``reconfigure``: ``(step, {setter: value})`` applied before that step."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = GradScaler("cpu", **kw)
    scales, reads = [], 0
    for i, bad in enumerate(overflows):
        if reconfigure is not None and reconfigure[0] == i:
            for setter, value in reconfigure[1].items():
                getattr(scaler, setter)(value)
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


ODD = {"init_scale": 8.0, "growth_interval": 3, "backoff_factor": 0.3, "growth_factor": 1.7,
       "min_scale": 1.0, "max_scale": 100.0, "on_min_scale": "warn"}
CASES = {   # settings, the device's way (amp.device_scale), P(overflow)
    "torch-defaults": ({}, "fused", 0.35),
    "hysteresis-odd-factors-bounds": ({**ODD, "hysteresis": 2}, "general", 0.35),
    "odd-factors-bounds": (ODD, "fused", 0.35),
    "growth-to-max": ({"init_scale": 2.0 ** 20, "growth_interval": 2, "max_scale": 2.0 ** 22}, "fused", 0.35),
    # max_scale not a power of two: the growth 64 -> 128 is clamped to 100, the tracker reset
    "growth-clamped-to-odd-max": ({"init_scale": 64.0, "growth_interval": 2, "min_scale": 1.0,
                                   "max_scale": 100.0}, "fused", 0.1),
    # many overflows: the backoff 3 -> 1.5 clamped to min_scale 2, then stuck there (warned)
    "backoff-to-odd-min-and-stuck": ({"init_scale": 3.0, "growth_interval": 2, "min_scale": 2.0,
                                      "max_scale": 2.0 ** 10, "on_min_scale": "warn"}, "fused", 0.6),
    # a growth that would leave float32 (2**125 * 16): torch's kernel keeps the scale, the host
    # clamps to max_scale: not the fused way
    "growth-beyond-float32": ({"init_scale": 2.0 ** 120, "growth_factor": 16.0, "growth_interval": 1,
                               "max_scale": 2.0 ** 126}, "general", 0.2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_scale_moved_on_the_device_is_the_hosts_exactly(case):
    kw, way, p_overflow = CASES[case]
    rnd = random.Random(0)
    overflows = [rnd.random() < p_overflow for _ in range(60)]
    with pytest.warns(RuntimeWarning) if kw.get("on_min_scale") == "warn" else _nothing():
        lazy, lazy_scales, lazy_reads = _run(overflows, True, **kw)
        assert (lazy._dev_tracker is not None, lazy._dev_state is not None) == (way == "fused", way == "general")
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


@pytest.mark.parametrize("hysteresis", [1, 2], ids=["fused", "general"])
def test_a_growth_interval_shortened_below_the_clean_steps_grows_at_the_next_clean_step(hysteresis):
    # 7 clean steps under interval 10, then interval 3: the host grows at the next clean step
    # (clean_steps >= interval); torch's tracker grows only at == interval, so the device's is
    # rebuilt from the host's, clamped below the new interval.
    overflows = [False] * 7 + [False, False, True, False, False, False, False]
    kw = {"init_scale": 16.0, "growth_interval": 10, "hysteresis": hysteresis,
          "reconfigure": (7, {"set_growth_interval": 3})}
    lazy, lazy_scales, _ = _run(overflows, True, **kw)
    eager, eager_scales, _ = _run(overflows, False, **kw)
    assert lazy_scales == eager_scales
    assert lazy_scales[7] == 32.0                   # grew at once
    assert lazy.state_dict() == eager.state_dict()


def test_the_fused_update_changes_no_scale_tensor_a_loss_was_multiplied_by():
    # The scale of step t is autograd's saved factor of the scaled loss: the update writes a new
    # tensor (a backward after update(), retain_graph, still sees the scale it was taken with).
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = GradScaler("cpu", init_scale=4.0, growth_interval=1)
    for _ in range(2):
        scaled = scaler.scale((p * 1.0).sum())
        scaled.backward(retain_graph=True)
        scaler.found_inf(opt)
        scaler.stepped_on_device(opt)
        scaler.update()
        opt.zero_grad()
        scaled.backward()                           # the factor is unchanged: no version error
        assert p.grad.tolist() == [float(scaled.item()) / 3] * 3
        opt.zero_grad()
    assert scaler.get_scale() == 16.0
