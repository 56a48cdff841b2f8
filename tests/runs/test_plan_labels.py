"""A run with per-layer formats (a plan) is labelled as one everywhere, from ``Precision.recipe.label``:
its run folder, its last line, ``config.toml`` and the comparison report; and the FP8 start line
names every recipe a plan mixes."""
from __future__ import annotations

import os

import pytest

import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec.precision import Precision
from mixprec.report.compare import compare_summary, load_run, write_comparison
from mixprec.runs.read import run_label

PLAN = (("fc", "fp8-blockwise"), ("*", "fp8-tensorwise"))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, 32)
        self.fc = nn.Linear(32, 32)
        self.mid = nn.Linear(32, 32)
        self.head = nn.Linear(32, 64)

    def forward(self, idx, targets):
        h = self.mid(F.gelu(self.fc(self.emb(idx))))
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def _loader():
    g = torch.Generator().manual_seed(0)
    return [(x, (3 * x) % 64) for x in (torch.randint(0, 64, (2, 8), generator=g) for _ in range(2))]


def _fit(run_dir, **kw):
    return mp.train.fit(_Net(), _loader(), mixed_precision="32-true", max_steps=2, run_dir=run_dir,
                        progress=False, audit=False, log_interval=1, eval_interval=0,
                        ckpt_interval=0, **kw)


def test_the_label_is_the_mode_or_the_mode_with_plan():
    assert Precision("32-true").recipe.label == "32-true" and not Precision("32-true").recipe.has_plan
    plan = Precision("32-true", overrides=PLAN)
    assert plan.recipe.label == "32-true+plan" and plan.recipe.has_plan
    assert plan.layers.ran() == "32-true+plan"                      # before set-up: no layer counts yet
    plan.setup_module(_Net())
    assert plan.layers.ran() == "32-true+plan (1 fp8-blockwise, 1 fp8-tensorwise, 1 fp32)"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A plan run and a plain run, in default-named folders (two short fits for the module)."""
    here, there = os.getcwd(), tmp_path_factory.mktemp("labels")
    os.chdir(there)
    try:
        results = _fit(None, precision_overrides=PLAN), _fit(None)
    finally:
        os.chdir(here)
    for r in results:
        r.run_dir = there / r.run_dir          # the default folder is under the cwd's runs/
    return results


def test_a_plan_run_is_labelled_a_plan_in_its_folder_result_and_config(runs):
    plan, plain = runs
    assert plan.run_dir.name.endswith("-32-true+plan")      # was "...-32-true"
    assert plan.policy == "32-true+plan (1 fp8-blockwise, 1 fp8-tensorwise, 1 fp32)"  # the last line's
    config = (plan.run_dir / "config.toml").read_text()
    assert 'precision = "32-true"' in config                 # what a resume rebuilds from
    assert "# ran: 32-true+plan (1 fp8-blockwise, 1 fp8-tensorwise, 1 fp32)" in config
    assert plain.run_dir.name.endswith("-32-true") and plain.policy == "32-true"
    assert "# ran:" not in (plain.run_dir / "config.toml").read_text()


def test_the_comparison_does_not_call_a_plan_run_the_reference(runs, tmp_path):
    plan, plain = runs
    loaded = [load_run(plan.run_dir), load_run(plain.run_dir)]
    assert [r["precision"] for r in compare_summary(loaded)] == ["32-true+plan", "32-true"]
    page = write_comparison([plan.run_dir, plain.run_dir], tmp_path / "cmp").read_text()
    assert "the reference" not in page and "a per-layer plan (32-true+plan)" in page
    page = write_comparison([plain.run_dir, plan.run_dir], tmp_path / "cmp2").read_text()
    assert "against the reference" in page                  # a uniform first run is the reference


def test_runs_recorded_before_the_label_are_labelled_from_their_config():
    assert run_label({"precision": "32-true", "overrides": {"fc": "nvfp4"}}, []) == ("32-true+plan", True)
    assert run_label({"precision": "bf16-mixed"}, []) == ("bf16-mixed", False)
    assert run_label({"precision": "32-true"}, [{"kind": "start", "label": "32-true+plan",
                                                 "plan": True}]) == ("32-true+plan", True)


def test_the_fp8_start_line_names_each_recipe_a_plan_mixes():
    precision = Precision("32-true", overrides=PLAN)
    precision.setup_module(_Net())
    head = str(precision.layers.fp8_report).splitlines()[0]
    # Was "fp8-blockwise (...): 2 Linear layers converted": one recipe named for two.
    assert head.startswith("1 fp8-blockwise (blockwise scaling") and ", 1 fp8-tensorwise (tensorwise" in head
    assert "2 Linear layers converted" in head
    one = Precision("fp8-tensorwise")
    one.setup_module(_Net())
    assert str(one.layers.fp8_report).startswith("fp8-tensorwise (tensorwise scaling")


def test_the_micro_start_line_counts_each_format_a_plan_mixes():
    precision = Precision("32-true", overrides=(("fc", "mxfp8"), ("*", "nvfp4")))
    precision.setup_module(_Net())
    head = str(precision.layers.micro_report).splitlines()[0]
    assert head.startswith("1 mxfp8 (") and ", 1 nvfp4 (" in head and "2 Linear layers converted" in head
