"""``rewind``: a scheduler goes back to an earlier step count with its current settings."""
import pytest
import torch

from mixprec.optim.schedule import restretch, rewind, warmup_cosine_scheduler


def _opt():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)


def test_rewind_keeps_a_restretched_curve_and_takes_the_saved_step():
    opt = _opt()
    sched = warmup_cosine_scheduler(opt, warmup_steps=2, total_steps=10, min_ratio=0.1)
    for _ in range(3):
        opt.step()
        sched.step()
    saved = sched.state_dict()                      # step 3 under peak 1e-3, 10 steps
    for _ in range(2):
        opt.step()
        sched.step()
    restretch(sched, base_lrs=[4e-3], warmup_steps=2, total_steps=20, min_ratio=0.1)
    lrs = rewind(sched, saved)
    curve = sched.lr_lambdas[0]
    assert sched.last_epoch == 3 and curve.total_steps == 20 and sched.base_lrs == [4e-3]
    assert lrs == [pytest.approx(4e-3 * curve(3), rel=1e-12)]
    assert opt.param_groups[0]["lr"] == lrs[0] == sched.get_last_lr()[0]
    opt.step()
    sched.step()                                    # and goes on from there on the new curve
    assert opt.param_groups[0]["lr"] == pytest.approx(4e-3 * curve(4), rel=1e-12)


def test_rewind_loads_other_schedulers_whole():
    opt = _opt()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    saved = sched.state_dict()
    for _ in range(4):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(2.5e-4)
    assert rewind(sched, saved) == [1e-3] and opt.param_groups[0]["lr"] == 1e-3
    assert sched.last_epoch == 0
