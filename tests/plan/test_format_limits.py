"""Per-format limits (mixprec/formats/limits.py): the guard, the planner's gates and the what-if's
safe verdict judge a layer by its own format's yardstick, so they agree: a what-if plan with NVFP4
layers trains under guard=true without promotions, ``plan()`` can choose NVFP4, and an outlier
layer still fails in FP4. FP8's limits are those of before (20 dB, 1 %, gradients 15 dB)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec.formats.limits import HEALTHY, format_limits
from mixprec.monitor.guard import GuardConfig, StepOutcome, TrainingGuard

from guard_nets import Net, loader

OUTLIER = "blocks.0.proj"


def _guard(net: nn.Module, fmt: str, **config) -> tuple[mp.Precision, TrainingGuard]:
    precision = mp.Precision("32-true", overrides=(("*", fmt),))
    precision.setup(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return precision, TrainingGuard(precision, net, opt, sched, config=GuardConfig(every=1, **config))


def _trained_net(boost: bool = False) -> Net:
    """The guard tests' net after 20 FP32 AdamW steps (weights away from their initialisation)."""
    net = Net(boost=boost)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    for x, y in loader(seed=1, n=20):
        opt.zero_grad()
        net(x, y).backward()
        opt.step()
    return net


def test_fp8_keeps_its_limits_and_fp4_gets_its_own():
    fp8 = format_limits("fp8-tensorwise")
    assert (fp8.min_sqnr_db, fp8.max_flush, fp8.min_grad_sqnr_db) == (20.0, 0.01, 15.0)
    nv, mx4 = format_limits("nvfp4"), format_limits("mxfp4")
    assert nv.min_sqnr_db == 8.0 and nv.max_flush == pytest.approx(0.42)
    assert mx4.min_sqnr_db == 7.0 and mx4.max_flush == pytest.approx(0.555)
    assert format_limits("bf16").min_sqnr_db == 20.0        # capped at FP8's bar
    given = format_limits("nvfp4", min_sqnr_db=20.0, max_flush=0.01)
    assert (given.min_sqnr_db, given.max_flush, given.given) == (20.0, 0.01, True)


@pytest.mark.parametrize("fmt", ["fp8-tensorwise", "mxfp8", "mxfp4", "nvfp4"])
def test_the_healthy_figures_are_what_the_formats_quantizer_gives(fmt):
    """The table's healthy SQNR is the Gaussian-input Linear's (to 1 dB) and its flushed share at
    least what SiLU-gated inputs (a gated MLP's down projection, the most flushed) lose."""
    g = torch.Generator().manual_seed(0)
    lin = nn.Sequential(nn.Linear(256, 256))
    with torch.no_grad():
        lin[0].weight.copy_(torch.randn(256, 256, generator=g) / 16)
    gauss = torch.randn(512, 256, generator=g)
    gated = F.silu(torch.randn(512, 256, generator=g)) * torch.randn(512, 256, generator=g)
    _, guard = _guard(lin, fmt)
    sqnr = guard.sample_sqnr(lambda: lin(gauss))["0"]
    guard.sample_sqnr(lambda: lin(gated))
    healthy_sqnr, healthy_flush = HEALTHY[fmt]
    assert abs(sqnr - healthy_sqnr) < 1.0
    assert guard.last_flush["0"] <= healthy_flush


def test_a_whatif_plan_with_nvfp4_layers_trains_under_the_guard_without_promotions(tmp_path):
    """Before: the guard held NVFP4 to FP8's 20 dB / 1 % and moved every NVFP4 layer of the
    what-if's own plan back to bf16 at step 1."""
    net = _trained_net()
    report = mp.plan.what_if(net, loader(seed=2, n=2), formats=("nvfp4", "bf16"), gpu="B200")
    planned = {n for n, f in report.choices.items() if f == "nvfp4"}
    assert len(planned) >= 3, report.table()
    trainer = mp.Trainer(net, mixed_precision=mp.Precision("32-true", overrides=report.overrides),
                         max_steps=2, run_dir=str(tmp_path / "run"), progress=False, audit=False,
                         guard=True, ckpt_interval=0, log_interval=1, lr=1e-3)
    trainer.fit(loader(seed=3, n=4))
    assert [a.message for a in trainer.guard.actions] == []
    assert {n for n, f in trainer.precision.layers.formats.items() if f == "nvfp4"} == planned


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_an_outlier_layer_is_still_promoted_from_fp4_and_the_others_are_not(fmt):
    net = _trained_net(boost=True)
    net.blocks[0].grow_outliers()
    precision, guard = _guard(net, fmt)
    x, y = loader()[0]
    actions = guard.after_step(StepOutcome(1, 2.0, False), lambda: net(x, y))
    promoted = [(a.switch.module, a.switch.new) for a in actions if a.kind == "promote"]
    assert promoted == [(OUTLIER, "bf16")], [a.message for a in actions]
    assert "SQNR" in next(a.message for a in actions if a.kind == "promote")


def test_a_given_guard_limit_applies_to_every_format_as_given():
    net = _trained_net()
    precision, guard = _guard(net, "nvfp4", min_sqnr_db=20.0)
    x, y = loader()[0]
    actions = guard.after_step(StepOutcome(1, 2.0, False), lambda: net(x, y))
    assert {a.switch.module for a in actions if a.kind == "promote"} == set(guard.last_sqnr)
    assert "nvfp4's given limit" in actions[-1].message


def test_plan_can_choose_nvfp4_for_healthy_layers_and_refuses_it_for_the_outlier():
    """Before: the 1 % flush gate refused NVFP4 on every layer."""
    net = _trained_net(boost=True)
    net.blocks[0].grow_outliers()
    plan = mp.plan.plan_precision(net, loader(seed=2, n=2), candidates=("bf16", "nvfp4"), target="B200",
                             budget=0.05, heldout=[])
    by_name = {m.name: m for m in plan.layers}
    assert "nvfp4" in by_name[OUTLIER].risky
    healthy = [m for m in plan.layers if m.name != OUTLIER and "nvfp4" in m.sqnr_out]
    assert healthy and not any("nvfp4" in m.risky for m in healthy), plan.table()
    assert "nvfp4" in plan.formats.values()
    assert "nvfp4 < 8 dB" in plan.table()


def test_the_peer_check_spares_a_layer_at_its_formats_healthy_level():
    """Measured on a trained ``small`` (docs/per-layer.md): MLP-input and QKV layers sit 8-9 dB
    below the MLP-output layers in every format. Before, the planner refused NVFP4 and FP8 on all
    of them for standing 4 dB below the median, and then chose MXFP4 for them."""
    from mixprec.monitor.gates import output_refusal
    assert output_refusal(20.5, "nvfp4", [26.0, 29.0, 21.0, 29.5, 28.0]) is None
    assert output_refusal(32.4, "fp8-tensorwise", [37.0, 38.5, 33.0, 41.0, 40.0]) is None
    low = output_refusal(12.0, "nvfp4", [20.0, 21.0, 29.0, 29.0])      # under 16.5 and 4 dB down
    assert low is not None and "below the other layers' median" in low[0]
    assert "< 8" in output_refusal(4.5, "nvfp4", [])[0]
    assert output_refusal(12.0, "nvfp4", [20.0]) is None                 # one peer: no median
