"""A step skipped on an accelerator steps its chunks' counters back without waiting for the flag.

torch's AdamW keeps ``step`` on the host and the skip flag is on the device: stepping the counter
back at once (``step.sub_(skip.to("cpu"))``) copied the flag to the host and waited for it, a sync
in every masked step on CUDA (found by the kernel work, 2026-12-05). Now the step queues a host
copy and ``FlatSteps.settle`` (``flat_skip.SkipMask.settle``) reads it before the counters are read again: the next step, or
``state_dict()``. On a CPU flag and counter share a device and nothing is queued; these tests
force the queued path there (``flat_skip._queues_copy``) and check it against the immediate one.
"""
from __future__ import annotations

import pytest
import torch

from mixprec.optim import AdamW, flat_skip
from mixprec.optim.inputs import StepInputs

from tests.optim.test_step_cost import LAYOUTS, OpCounter, _assert_same_bits, _backward, _model, _step_counters


def _run(queued: bool, layout: dict, monkeypatch, skips=(1, 2), steps: int = 5, probe=None):
    monkeypatch.setattr(flat_skip, "_queues_copy", lambda step, skip: queued)
    model = _model(2)
    opt = AdamW(model.parameters(), lr=1e-2, seed=1, **layout)
    dicts = []
    for i in range(steps):
        _backward(model, i)
        if probe is not None and i == probe[0]:
            with OpCounter() as probe[1]:
                opt.step(inputs=StepInputs(found_inf=torch.tensor(float(i in skips))))
        else:
            opt.step(inputs=StepInputs(found_inf=torch.tensor(float(i in skips))))
        opt.zero_grad()
        if probe is None:
            sd = opt.state_dict()             # settles: the counters as the immediate path has them
            dicts.append(sorted({float(st["step"]) for st in sd["state"].values()}))
    if probe is not None:
        probe.append(_step_counters(opt))
    return model, opt.state_dict(), dicts


@pytest.mark.parametrize("layout", ["full", "split", "bf16", "int8"])
def test_queued_counter_step_back_gives_the_bits_of_the_immediate_one(layout, monkeypatch):
    ma, sa, da = _run(True, LAYOUTS[layout], monkeypatch)
    mb, sb, db = _run(False, LAYOUTS[layout], monkeypatch)
    _assert_same_bits(ma, sa, mb, sb)
    assert da == db == [[1.0], [1.0], [1.0], [2.0], [3.0]]   # two skipped steps advanced nothing


def test_a_masked_step_reads_only_the_previous_steps_flag_copy_before_its_update(monkeypatch):
    # Step 2 follows the skipped step 1: its one read is step 1's queued flag copy, at its start,
    # before any update op; step 1's own flag is not read during step 1.
    probe = [2, None]
    _run(True, LAYOUTS["split"], monkeypatch, skips=(1,), steps=3, probe=probe)
    order, counters = probe[1].order, probe[2]       # reads of torch's host step counters aside
    reads = [i for i, (n, storage) in enumerate(order) if n == "_local_scalar_dense" and storage not in counters]
    first_update = min(i for i, (n, _) in enumerate(order) if n.startswith("_foreach"))
    assert len(reads) == 1 and reads[0] < first_update
    probe = [1, None]                     # the skipped step itself: no read of its own flag
    _run(True, LAYOUTS["split"], monkeypatch, skips=(1,), steps=2, probe=probe)
    assert not [s for n, s in probe[1].order if n == "_local_scalar_dense" and s not in probe[2]]
