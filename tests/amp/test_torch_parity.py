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
        with mixprec.precision.autocast("bf16-mixed", device_type="cpu"):
            outputs = model(inputs)
            loss = criterion(outputs.float(), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        first = first if first is not None else loss.item()
    assert scaler.num_skipped_steps == 0 and scaler.get_scale() == 256.0
    assert loss.item() < first


def test_autocast_lives_in_precision_and_its_old_amp_path_says_so():
    with pytest.raises(ImportError, match=r"^mixprec\.amp\.autocast moved to mixprec\.precision\.autocast in 0\.4; see CHANGELOG\.md$"):
        from mixprec.amp import autocast  # noqa: F401


# --- defaults and the small differences, each side by side with torch.amp.GradScaler ----------

def _overflow_pattern(seed: int, n: int, p: float) -> list[bool]:
    rng = random.Random(seed)
    return [rng.random() < p for _ in range(n)]


def test_default_scaler_follows_torch_through_a_seeded_200_step_overflow_pattern():
    # 20% overflows with growth_interval=3 drive the scale far below 1: torch goes on halving.
    seq = _overflow_pattern(seed=9, n=200, p=0.2)
    ours_p, theirs_p = (torch.nn.Parameter(torch.ones(4)) for _ in range(2))
    ours = GradScaler(growth_interval=3)
    theirs = torch.amp.GradScaler("cpu", growth_interval=3)
    a = _drive(ours, seq, ours_p, torch.optim.SGD([ours_p], lr=0.1))
    b = _drive(theirs, seq, theirs_p, torch.optim.SGD([theirs_p], lr=0.1))
    assert min(b) < 1.0                      # the pattern does reach below the old floor of 1
    assert a == b
    assert torch.equal(ours_p, theirs_p)


def test_from_policy_keeps_the_strict_floor_and_raises_when_stuck():
    seq = _overflow_pattern(seed=9, n=200, p=0.2)
    p = torch.nn.Parameter(torch.ones(4))
    scaler = GradScaler.from_policy("16-mixed", growth_interval=3)
    assert scaler.loss_scaler.config.min_scale == 1.0
    assert scaler.loss_scaler.config.max_scale == 2.0 ** 24
    with pytest.raises(mixprec.errors.NumericsError, match="stuck at min_scale=1"):
        _drive(scaler, seq, p, torch.optim.SGD([p], lr=0.1))


def test_from_policy_passes_the_trainers_explicit_floor_and_stuck_policy_through():
    scaler = GradScaler.from_policy("16-mixed", min_scale=4.0, on_min_scale="warn")
    cfg = scaler.loss_scaler.config
    assert (cfg.min_scale, cfg.max_scale, cfg.on_min_scale) == (4.0, 2.0 ** 24, "warn")


def _step_without_gradients(scaler):
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale(torch.ones((), requires_grad=True) * 2)   # a loss that does not reach p
    scaler.step(opt)


def test_step_without_gradients_raises_assertion_error_like_torch():
    with pytest.raises(AssertionError, match="No inf checks were recorded"):
        _step_without_gradients(torch.amp.GradScaler("cpu"))
    with pytest.raises(AssertionError, match="No inf checks were recorded"):
        _step_without_gradients(GradScaler())


def test_step_without_gradients_with_scaling_off_just_steps_like_torch():
    for scaler in (torch.amp.GradScaler("cpu", enabled=False), GradScaler(enabled=False)):
        _step_without_gradients(scaler)
        scaler.update()


@pytest.mark.parametrize("outputs", [3.0, [torch.ones(()), 3.0], (torch.ones(()), None)])
def test_scale_of_a_non_tensor_raises_value_error_like_torch(outputs):
    with pytest.raises(ValueError, match="must be a Tensor or an iterable of Tensors"):
        torch.amp.GradScaler("cpu").scale(outputs)
    with pytest.raises(ValueError, match="must be a Tensor or an iterable of Tensors"):
        GradScaler().scale(outputs)


def test_state_dict_of_a_disabled_scaler_is_empty_like_torch():
    assert GradScaler(enabled=False).state_dict() == torch.amp.GradScaler("cpu", enabled=False).state_dict() == {}


def test_disabled_scaler_keeps_its_skip_counters_outside_the_state_dict():
    p = torch.nn.Parameter(torch.ones(3))
    scaler = GradScaler(enabled=False)
    _drive(scaler, [True, False], p, torch.optim.SGD([p], lr=0.1))
    fresh = GradScaler(enabled=False)
    fresh.load_state_dict({**scaler.state_dict(), **scaler.counters})
    assert (fresh.num_skipped_steps, fresh.num_overflows) == (1, 1)
