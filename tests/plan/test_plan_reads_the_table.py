"""The planner and the what-if measure the layers the per-layer table offers, and no other:
a layer the table keeps in FP32 (an MoE gate named ``gating``, a ``keep_in_fp32`` tag) is never
a candidate; each candidate's current format is the table's."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec.errors import ConfigError


class _Tagged(nn.Linear):
    keep_in_fp32 = True                      # the user's own "keep me in FP32" tag


class _Moe(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, d)
        self.fc = nn.Linear(d, d)
        self.gating = nn.Linear(d, d)        # a router by name: the rule book keeps it in FP32
        self.tagged = _Tagged(d, d)
        self.out = nn.Linear(d, 64)

    def forward(self, idx, targets):
        h = self.emb(idx)
        h = self.fc(h) * torch.softmax(self.gating(h), dim=-1) + self.tagged(h)
        return F.cross_entropy(self.out(h).flatten(0, 1), targets.flatten())


def _batches():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 64, (2, 8), generator=g) for _ in range(2)]
    return [(x, (3 * x + 1) % 64) for x in xs]


def _model():
    torch.manual_seed(0)
    return _Moe()


def test_the_planners_candidates_are_the_tables_and_never_a_layer_kept_fp32():
    model = _model()
    table = mp.Precision("bf16-mixed").resolve(model)
    assert set(table.kept_fp32) == {"gating", "tagged"}
    plan = mp.plan.plan_precision(model, _batches(), candidates=("fp32", "bf16"), base="bf16-mixed",
                             target="H100", seed=0)
    assert list(plan.formats) == list(table.plannable) == ["fc", "out"]
    assert {m.name: m.current for m in plan.layers} == table.plannable == {"fc": "bf16", "out": "bf16"}
    note = next(n for n in plan.notes if n.startswith("kept in FP32, not planned"))
    assert "gating (kept FP32: MoE gate/router)" in note and "tagged (kept FP32: keep_in_fp32)" in note
    assert "gating" not in dict(plan.overrides) and "tagged" not in dict(plan.overrides)


def test_asking_to_plan_a_layer_the_table_keeps_fp32_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"'gating' is kept in FP32 \(kept FP32: MoE gate/router\)"):
        mp.plan.plan_precision(_model(), _batches(), candidates=("fp32", "bf16"), target="H100",
                          layers=["gating"])
    with pytest.raises(ConfigError, match="no Linear named 'fcc'"):
        mp.plan.plan_precision(_model(), _batches(), candidates=("fp32", "bf16"), target="H100",
                          layers=["fcc"])


def test_the_what_if_asks_about_the_same_layers():
    model = _model()
    report = mp.plan.what_if(model, _batches(), formats=("bf16",), gpu="H100")
    assert [r.name for r in report.rows] == list(mp.Precision("32-true").resolve(model).plannable)
    assert any(n.startswith("kept in FP32, not planned: gating") for n in report.notes)


def test_a_base_plans_fp32_override_does_not_hide_a_layer_from_the_new_plan(tmp_path):
    from mixprec.policy.overrides import write_plan
    old = write_plan(tmp_path / "old.toml", "bf16-mixed", (("fc", "fp32"),))
    plan = mp.plan.plan_precision(_model(), _batches(), candidates=("fp32", "bf16"), base=f"plan:{old}",
                             target="H100", seed=0)
    assert list(plan.formats) == ["fc", "out"] and plan.base == "bf16-mixed"
    assert "the base's 1 per-layer overrides are replaced by this plan's" in plan.notes


def test_the_formats_a_variant_refuses_are_the_tables_refusals():
    """``format_variants`` reports why a layer does not take a format from the table its set-up
    resolved (the one eligibility function's reason), not from a re-derived answer."""
    from mixprec.plan.measure import format_variants
    model = _model()
    _, refused = format_variants(model, ["fp8-tensorwise", "mxfp8"], torch.device("cpu"))
    for fmt, why in refused.items():
        precision = mp.Precision("32-true", overrides={"*": fmt}, device="cpu")
        precision.setup(_model())
        assert why == {r.name: r.refused or f"runs {r.compute}" for r in precision.layers.table
                       if r.per_layer and r.compute != fmt}
        assert why["gating"] == "MoE gate/router ('gating', Linear)" and "fc" not in why


def test_the_audit_asks_the_table_what_a_layer_is(monkeypatch):
    """A 16-bit MoE gate is found as the table's kind says: relabel the row and the finding follows."""
    from mixprec.monitor.audit import audit
    from mixprec.precision.layers import Layers
    model = _model()
    model.gating.to(torch.bfloat16)
    assert "half-precision-gate" in {f.code for f in audit(model, policy="32-true")}
    real = Layers.resolve

    def relabelled(self, m):
        table = real(self, m)
        return dataclasses.replace(table, rows=tuple(
            dataclasses.replace(r, kind="linear") if r.name == "gating" else r for r in table))
    monkeypatch.setattr(Layers, "resolve", relabelled)
    assert "half-precision-gate" not in {f.code for f in audit(model, policy="32-true")}
