"""The per-layer planner: sensitivity measured per layer and format, a plan within the loss budget."""
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec.errors import ConfigError

OUTLIER_LAYER = "blocks.2.proj"


class _Block(nn.Module):
    def __init__(self, d: int, h: int, outliers: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, h)
        self.proj = nn.Linear(h, d)
        boost = torch.ones(h)
        boost[list(outliers)] = 1e4          # a few activation channels 10^4 times the rest ...
        self.register_buffer("boost", boost)
        with torch.no_grad():                # ... and weights that undo it: same function in FP32
            self.proj.weight[:, list(outliers)] /= 1e4

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.norm(x))) * self.boost)


class _Net(nn.Module):
    def __init__(self, outlier_block: int | None = 2, d: int = 64, h: int = 128, n: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, d)
        self.blocks = nn.ModuleList(_Block(d, h, (3, 50, 90) if i == outlier_block else ())
                                    for i in range(n))
        self.head = nn.Linear(d, 256)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _batches(n: int = 3, seed: int = 0):
    """A learnable task (target = 7 * token + 3 mod 256)."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randint(0, 256, (8, 32), generator=g) for _ in range(n)]
    return [(x, (7 * x + 3) % 256) for x in xs]


def _trained(steps: int = 30) -> nn.Module:
    """At initialisation no layer matters to the loss; a few steps make the layers count."""
    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for x, y in _batches(steps, seed=1):
        opt.zero_grad()
        net(x, y).backward()
        opt.step()
    return net


@pytest.fixture(autouse=True)
def every_plan_keeps_its_budget(monkeypatch):
    """The promise, checked on every plan a test here builds through ``mp.plan.plan_precision``: the
    whole plan's measured loss change, on the calibration and on the held-out batches, is at most
    the budget (the module-scoped ``plan`` below asserts it itself)."""
    real = mp.plan.plan_precision

    def checked(*args, **kwargs):
        p = real(*args, **kwargs)
        assert p.measured_calibration is not None and p.measured_calibration <= p.budget, p.notes
        assert p.measured_heldout is None or p.measured_heldout <= p.budget, p.notes
        return p
    monkeypatch.setattr(mp.plan, "plan_precision", checked)


@pytest.fixture(scope="module")
def plan():
    p = mp.plan.plan_precision(_trained(), _batches(), candidates=("fp32", "bf16", "fp8-tensorwise"),
                          budget=1e-3, target="H100", seed=0)
    assert p.measured_heldout <= p.budget and p.measured_calibration <= p.budget
    return p


def test_outlier_layer_stays_out_of_fp8_tensorwise_while_most_others_go_fp8(plan):
    formats = plan.formats
    assert not formats[OUTLIER_LAYER].startswith("fp8")
    others = [n for n in formats if n.startswith("blocks.") and n != OUTLIER_LAYER]
    # (the whole-plan check moves back the layers the estimate under-rates: 2 of 7 here)
    assert sum(formats[n] == "fp8-tensorwise" for n in others) >= len(others) - 3
    by_name = {m.name: m for m in plan.layers}
    worst_other = min(by_name[n].sqnr_out["fp8-tensorwise"] for n in others)
    assert by_name[OUTLIER_LAYER].sqnr_out["fp8-tensorwise"] < worst_other - 3    # dB
    est = {n: by_name[n].loss_change_est["fp8-tensorwise"] for n in formats if n != "head"}
    assert est[OUTLIER_LAYER] > 3 * max(v for n, v in est.items() if n != OUTLIER_LAYER)
    assert plan.loss_change <= plan.budget
    assert "head" in by_name and "fp8-tensorwise" in by_name["head"].unavailable  # FP8 rules
    assert "chosen" in plan.table()


@pytest.mark.parametrize("budget", [1e-3, 3e-3, 1e-2])
def test_default_plan_keeps_the_outlier_layer_out_of_fp8_and_its_measured_budget(budget):
    # The default candidates (both FP8 recipes); the promise is the whole plan's measured change
    # on held-out batches the per-layer measurements never saw.
    p = mp.plan.plan_precision(_trained(), _batches(), budget=budget, target="H100", seed=0)
    assert not p.formats[OUTLIER_LAYER].startswith("fp8")
    assert p.heldout_tokens == 256 and p.calibration_tokens == 512       # 1 of 3 batches held out
    assert p.measured_heldout <= budget and p.measured_calibration <= budget
    assert p.loss_change == max(p.measured_heldout, p.measured_calibration)
    assert p.notes[0].startswith("measured: the whole plan changes the loss by") and "256 tokens" in p.notes[0]
    fp8 = sum(f.startswith("fp8") for f in p.formats.values())
    assert fp8 >= 1                                                        # the plan still saves
    # How many layers a tight budget keeps in FP8 depends on the CPU's BF16/FP32 kernels (an
    # AVX512-BF16 host measures the all-FP8 plan at 0.12 %, over 0.1 %, and moves more back; each
    # move is recorded); a budget well above the whole plan's change keeps most layers in FP8.
    if budget >= 3e-3:
        assert fp8 >= 5
    else:
        assert fp8 >= 5 or p.demoted


def test_the_outlier_layer_ranks_most_sensitive_and_is_refused_by_the_gates(plan):
    blocks = [m for m in plan.layers if m.name.startswith("blocks.")]
    ranked = sorted(blocks, key=lambda m: m.sensitivity("fp8-tensorwise"), reverse=True)
    assert ranked[0].name == OUTLIER_LAYER
    assert "fp8-tensorwise" in ranked[0].risky and "flushed" in ranked[0].risky["fp8-tensorwise"]
    assert not any(m.risky for m in ranked[1:])
    assert all(m.sqnr_dgrad["fp8-tensorwise"] < m.sqnr_dgrad["bf16"] for m in blocks)


def test_a_plan_over_budget_when_measured_moves_its_worst_layers_back():
    # The estimate admits more FP8 than the whole plan, measured, can afford: the planner moves
    # layers back until the measured change fits, and says which.
    p = mp.plan.plan_precision(_trained(), _batches(), candidates=("fp32", "bf16", "fp8-tensorwise"),
                          budget=3e-4, target="H100", seed=0)
    assert p.spent <= 3e-4 and p.demoted
    assert p.loss_change <= 3e-4
    for d in p.demoted:
        assert p.formats[d["layer"]] != d["from"]
    assert f"moved back after measuring the whole plan: {p.demoted[0]['layer']}" in p.table()


def test_the_table_and_plan_file_show_predicted_and_measured(plan, tmp_path):
    text = plan.table()
    assert "meas/est" in text and "o/dx/dw" in text
    assert "whole-plan loss change" in text and "estimated" in text and "held-out tokens" in text
    assert "trade-off: predicted" in text and "faster Linear GEMMs" in text
    data = json.loads(plan.write(tmp_path / "p.json").read_text())
    assert data["measured_heldout"] == plan.measured_heldout and data["heldout_tokens"] == 256
    assert data["loss_change_est"] == plan.loss_change_est and data["speedup"] > 1
    row = data["layers"][0]
    assert {"loss_change", "loss_change_est", "sqnr_dgrad", "flush_grad", "risky"} <= set(row)


def test_plan_is_deterministic_and_round_trips_as_a_precision(plan, tmp_path):
    some = ["blocks.1.fc", OUTLIER_LAYER]
    again = mp.plan.plan_precision(_trained(), _batches(), candidates=("fp32", "bf16", "fp8-tensorwise"),
                              budget=1e-3, target="H100", seed=0, layers=some)
    assert again.loss_change <= again.budget
    first = {m.name: m for m in plan.layers}
    for m in again.layers:      # the same measurements, bit for bit
        assert (m.sqnr_out, m.loss_change, m.loss_change_est) == \
            (first[m.name].sqnr_out, first[m.name].loss_change, first[m.name].loss_change_est)
    path = plan.write(tmp_path / "plan.json")
    assert json.loads(path.read_text())["layers"][0]["name"] == "blocks.0.fc"
    precision = mp.Precision(f"plan:{path}")
    model, _ = precision.setup(_Net())
    assert precision.layers.formats == plan.formats
    assert plan.plot(tmp_path / "plan.png").stat().st_size > 1000


def test_zero_budget_keeps_every_layer_at_its_exact_format():
    torch.manual_seed(0)
    p = mp.plan.plan_precision(_Net(outlier_block=None, n=1), _batches()[:1], candidates=("fp8-tensorwise",),
                          budget=0.0, target="H100", layers=["blocks.0.fc"])
    assert p.formats == {"blocks.0.fc": "fp32"}
    assert p.measured_calibration == 0.0 and p.measured_heldout is None    # one batch: none held out
    assert any("no held-out batch" in n for n in p.notes)
    with pytest.raises(ConfigError, match="did you mean 'blocks.0.fc'"):
        mp.plan.plan_precision(_Net(n=1), _batches(), layers=["blocks.0.fcc"], target="H100")


def test_measured_throughput_drops_fp8_where_it_would_be_emulated():
    from mixprec.plan import format_throughput
    thr, notes = format_throughput("measure", ["fp32", "bf16", "fp8-tensorwise"],
                                   device=torch.device("cpu"), n=64, min_time=0.01)
    assert set(thr) == {"fp32", "bf16"} and all(v > 0 for v in thr.values())
    assert any("fp8-tensorwise left out" in n for n in notes)
    a100, notes = format_throughput("A100", ["fp32", "bf16", "fp8-blockwise"], device=torch.device("cpu"))
    assert a100 == {"fp32": 19.5e12, "bf16": 312e12} and any("no FP8" in n for n in notes)


def test_choice_takes_the_more_accurate_of_two_equally_fast_formats():
    # Both FP8 recipes cost ~nothing by the estimate, so their time-per-loss ratios tie; the plan
    # must still end on the one with the smaller loss change.
    from mixprec.plan.plan import LayerMeasure, PrecisionPlan, choose
    m = LayerMeasure("fc", 600)
    m.loss_change = {"fp32": 0.0, "fp8-tensorwise": 1e-16, "fp8-blockwise": 0.0}
    m.loss_change_est = dict(m.loss_change)
    plan = PrecisionPlan(base="bf16-mixed", layers=[m], target="H100", budget=1e-3,
                         criterion="fisher", loss=1.0,
                         throughput={"fp32": 1.0, "fp8-tensorwise": 4.0, "fp8-blockwise": 4.0})
    choose(plan, ["fp32", "fp8-tensorwise", "fp8-blockwise"])
    assert plan.formats == {"fc": "fp8-blockwise"}
    assert plan.spent == 0.0


def test_a_hooked_layer_is_measured_on_what_reaches_its_forward():
    # A pre-hook doubling a Linear's input, with the weight halved, computes exactly what the plain
    # layer computes (powers of two are exact in every format), so every measurement must match;
    # measuring on recorded inputs through the hook again would double them a second time.
    def make(hooked: bool):
        torch.manual_seed(0)
        net = _Net(outlier_block=None, n=2)
        if hooked:
            with torch.no_grad():
                net.blocks[1].proj.weight /= 2
            net.blocks[1].proj.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
        return net

    kw = dict(candidates=("bf16", "fp8-tensorwise"), target="H100", layers=["blocks.1.proj"])
    plain, hooked = (mp.plan.plan_precision(make(h), _batches(), **kw).layers[0] for h in (False, True))
    for f in ("bf16", "fp8-tensorwise"):
        assert hooked.loss_change_est[f] == pytest.approx(plain.loss_change_est[f], rel=1e-4)
        assert hooked.sqnr_out[f] == pytest.approx(plain.sqnr_out[f], abs=0.01)
        assert hooked.loss_change[f] == pytest.approx(plain.loss_change[f], rel=1e-3, abs=1e-9)


def test_table_columns_stay_aligned_for_long_layer_names():
    from mixprec.plan.plan import LayerMeasure, PrecisionPlan
    layers = []
    for name in ("fc", "model.layers.0.self_attn.q_proj"):          # 31 characters
        m = LayerMeasure(name, 600, flops_share=0.5)
        m.sqnr_out = {"fp32": float("inf"), "bf16": 50.0}
        m.sqnr_grad = dict(m.sqnr_out)
        m.loss_change = m.loss_change_est = {"fp32": 0.0, "bf16": 1e-6}
        m.chosen = "bf16"
        layers.append(m)
    plan = PrecisionPlan(base="bf16-mixed", layers=layers, target="H100", budget=1e-3,
                         criterion="fisher", loss=1.0, throughput={"fp32": 1.0, "bf16": 2.0},
                         step_time=1.0, step_time_fp32=1.0, step_time_fastest=1.0)
    head, sub, *rows = plan.table().splitlines()[:4]
    share_end = head.index("flops") + len("flops")
    assert sub.index("share") + len("share") == share_end
    assert all(row.index("%") + 1 == share_end for row in rows)


def test_a_model_set_up_in_fp32_can_be_planned_and_one_set_up_otherwise_is_refused():
    # fit() in 32-true tags the model as set up; the planner's copies must still be set up anew.
    torch.manual_seed(0)
    net = _Net(outlier_block=None, n=1)
    mp.Precision("32-true").setup(net)
    p = mp.plan.plan_precision(net, _batches(2), candidates=("bf16",), target="H100", layers=["blocks.0.fc"])
    assert p.formats["blocks.0.fc"] in ("fp32", "bf16") and p.loss_change <= p.budget
    other = _Net(outlier_block=None, n=1)
    mp.Precision("bf16-true").setup(other)
    with pytest.raises(ConfigError, match="set up for precision"):
        mp.plan.plan_precision(other, _batches(2), target="H100")


def test_the_gate_mark_stands_in_front_of_the_refused_cell_not_under_the_loss_change(plan):
    """The '!' (refused by a gate, which reads SQNRs and the flushed share) sat under the
    'dloss%' head, as if the loss change were flagged; the heads did not line up with the values."""
    lines = plan.table().splitlines()
    sub, row = lines[1], next(line for line in lines if line.startswith(OUTLIER_LAYER + " "))
    cells = [i for i in range(len(sub)) if sub.startswith(" sqnr o/dx/dw dB", i)]
    assert row.count("!") == 1 and row.index("!") in cells               # first character of a cell
    start = row.index("!")
    flush_end = sub.index("flush%", start) + len("flush%")
    assert row[flush_end - 1] != " " and row[flush_end] == " "          # the share ends under "flush%"
    assert row[sub.index("dloss%", start)] != " "                        # the change starts under its head
