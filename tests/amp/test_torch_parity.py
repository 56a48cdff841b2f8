"""Side by side with torch.amp.GradScaler, seed 002's loop unchanged, and the autocast re-export."""
from __future__ import annotations

import math
import random

import pytest
import torch
from amp_helpers import batches, loss_of, tiny_model

import mixprec
import mixprec.amp
from mixprec.amp import GradScaler


def _drive(scaler, overflow_seq, param, opt):
    """Run scale/step/update on a one-parameter problem; returns the scale after each update."""
    scales = []
    for overflow in overflow_seq:
        opt.zero_grad()
        scaler.scale(param.sum()).backward()
        if overflow:
            param.grad[1] = math.inf
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("init, growth, backoff, interval", [
    (2.0 ** 20, 2.0, 0.5, 3), (2.0 ** 20, 2.0, 0.25, 1), (2.0 ** 20, 4.0, 0.5, 5),
    (1000.3, 1.7, 0.37, 2),                 # factors that round: float32 arithmetic must agree too
])
def test_scale_trajectory_equals_torch_gradscaler_with_hysteresis_1(seed, init, growth, backoff, interval):
    rng = random.Random(seed)
    seq = [rng.random() < rng.choice([0.1, 0.4]) for _ in range(60)]
    kwargs = dict(init_scale=init, growth_factor=growth, backoff_factor=backoff,
                  growth_interval=interval)
    ours_p, theirs_p = (torch.nn.Parameter(torch.ones(4)) for _ in range(2))
    ours = GradScaler("cpu", **kwargs, hysteresis=1, min_scale=2.0 ** -126, max_scale=2.0 ** 126)
    theirs = torch.amp.GradScaler("cpu", **kwargs)
    a = _drive(ours, seq, ours_p, torch.optim.SGD([ours_p], lr=0.1))
    b = _drive(theirs, seq, theirs_p, torch.optim.SGD([theirs_p], lr=0.1))
    assert a == b
    assert ours.state_dict()["_growth_tracker"] == theirs.state_dict()["_growth_tracker"]
    assert torch.equal(ours_p, theirs_p)


def test_defaults_match_torch():
    ours, theirs = GradScaler(), torch.amp.GradScaler("cpu")
    for getter in ("get_scale", "get_growth_factor", "get_backoff_factor", "get_growth_interval",
                   "is_enabled"):
        assert getattr(ours, getter)() == getattr(theirs, getter)(), getter


def test_state_dicts_are_interchangeable_with_torch():
    ours = GradScaler(init_scale=2.0 ** 10, growth_interval=7)
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(ours.state_dict())
    assert (theirs.get_scale(), theirs.get_growth_interval()) == (2.0 ** 10, 7)
    back = GradScaler()
    back.load_state_dict(theirs.state_dict())
    assert (back.get_scale(), back.get_growth_interval()) == (2.0 ** 10, 7)


@pytest.mark.parametrize("make_scaler", [lambda: GradScaler(init_scale=256),
                                         lambda: GradScaler(init_scale=256, growth_interval=500)])
def test_seed_002_loop_runs_unchanged(make_scaler):
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    criterion = torch.nn.MSELoss()
    train_loader = batches(30)
    scaler = make_scaler()
    first = None
    # --- the seed's loop, with autocast on the CPU instead of torch.cuda.amp ---
    for inputs, labels in train_loader:
        with mixprec.amp.autocast("bf16-mixed", device_type="cpu"):
            outputs = model(inputs)
            loss = criterion(outputs.float(), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        first = first if first is not None else loss.item()
    assert scaler.num_skipped_steps == 0 and scaler.get_scale() == 256.0
    assert loss.item() < first


def test_autocast_is_reexported_from_precision():
    assert mixprec.amp.autocast is mixprec.precision.autocast
