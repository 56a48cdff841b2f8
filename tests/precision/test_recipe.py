"""The recipe: every precision choice of a run in one frozen, printable, serialisable object,
validated once when built; a Precision is built from one and never changes its mode (#38 item 1)."""
import dataclasses

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.errors import ConfigError
from mixprec.policy.overrides import PlanOrigin
from mixprec.precision import Recipe
from mixprec.train.config import FitConfig, load_config

from tests.train.test_ready_precision import Regressor, data as _data

RECIPES = {
    "bf16-mixed": lambda: Recipe.build("bf16-mixed"),
    "16-mixed+scaler": lambda: Recipe.build("16-mixed", init_scale=1024.0, growth_interval=10,
                                            hysteresis=2, min_scale=0.5, on_min_scale="warn"),
    "bf16-true+lean": lambda: Recipe.build("bf16-true", split_masters=False, moments="int8",
                                           fp8_activations=True),
    "fp8+overrides": lambda: Recipe.build("fp8-blockwise", overrides={"head": "bf16", "blocks.0.*": "fp32"}),
    "nvfp4+options": lambda: Recipe.build("nvfp4", micro_options="hadamard_wgrad=false,bf16_last=none"),
    "compact": lambda: Recipe.build("p=f32,c=bf16,o=f32"),
    "custom policy": lambda: Recipe.build(mp.get_policy("bf16-true").replace(
        master_weights=False, keep_fp32_names=("emb*",), keep_fp32_types=(nn.LayerNorm,),
        keep_norms_fp32=False, allow_tf32=True)),
    "plan": lambda: Recipe(policy=mp.get_policy("32-true").replace(
        name="32-true", overrides=(("fc", "mxfp8"),),
        plan=PlanOrigin(path="plan.json", made_for="model=tiny", linears=("fc", "head")))),
}


@pytest.mark.parametrize("make", RECIPES.values(), ids=RECIPES.keys())
def test_a_recipe_round_trips_through_a_dict_and_a_toml_table(make):
    recipe = make()
    assert Recipe.from_dict(recipe.to_dict()) == recipe
    back = Recipe.from_toml(recipe.to_toml())
    assert back == recipe and back.policy.plan == recipe.policy.plan
    assert back.micro == recipe.micro and back.fp8 == recipe.fp8     # the configs rebuilt alike
    assert str(back) == str(recipe)


def test_a_recipe_is_frozen():
    recipe = Recipe.build("bf16-true")
    for name, value in (("moments", "int8"), ("policy", mp.get_policy("32-true")), ("split_masters", False)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(recipe, name, value)
    assert recipe.replace(moments="int8").moments == "int8" and recipe.moments == "fp32"


def test_str_is_one_readable_block_naming_every_choice():
    text = str(Recipe.build("16-true", moments="bf16", overrides={"head": "fp32"}, init_scale=1024.0))
    lines = text.splitlines()
    assert lines[0] == "recipe 16-true"
    for key in ("dtypes", "masters", "moments", "activations", "loss scale", "fp8", "micro", "overrides"):
        assert any(line.strip().startswith(key) for line in lines[1:]), key
    assert "params fp16, compute fp16" in text and "full FP32 copies" in text
    assert "init 1024" in text and "head=fp32" in text and "moments     bf16" in text


@pytest.mark.parametrize("mode, split, layout", [
    ("32-true", True, "none"), ("bf16-mixed", True, "none"), ("bf16-true", True, "split"),
    ("bf16-true", False, "full"), ("16-true", True, "full")])
def test_the_master_layout_follows_the_mode_and_split_masters(mode, split, layout):
    assert Recipe.build(mode, split_masters=split).masters == layout


@pytest.mark.parametrize("kwargs, message", [
    ({"precision": "bf61"}, "unknown precision 'bf61'"),
    ({"moments": "fp7"}, "moments must be one of fp32, bf16, int8, fp8, fp8-e5m2, got 'fp7'"),
    ({"micro_options": "hadamard=false"}, "unknown micro-format option 'hadamard'"),
    ({"overrides": {"head": "bf61"}}, "bf61"),
    ({"init_scale": -1.0}, "init_scale"),
    ({"init_scael": 1024.0}, "unknown loss-scaler setting 'init_scael' \\(did you mean 'init_scale'"),
])
def test_a_recipe_is_validated_once_when_built_in_one_line(kwargs, message):
    kwargs = {"precision": "16-mixed", **kwargs}
    with pytest.raises(ConfigError, match=message) as e:
        Recipe.build(kwargs.pop("precision"), **kwargs)
    assert "\n" not in str(e.value)


def test_every_gradscaler_setting_but_enabled_and_device_is_a_recipe_setting():
    p = mp.Precision("16-mixed", check_finite=False, backoff_factor=0.25, max_scale=2.0**20)
    assert p.recipe.scaler_options == {"check_finite": False, "backoff_factor": 0.25, "max_scale": 2.0**20}
    assert p.scaler.config.backoff_factor == 0.25 and p.scaler.config.max_scale == 2.0**20
    with pytest.raises(ConfigError, match="unknown loss-scaler setting 'enabled'"):
        Recipe.build("16-mixed", enabled=False)


def test_moments_without_masters_are_refused_when_the_recipe_is_built():
    no_masters = mp.get_policy("bf16-true").replace(master_weights=False)
    with pytest.raises(ConfigError, match="moments=int8 needs mixprec's AdamW"):
        Recipe.build(no_masters, moments="int8")


def test_from_dict_refuses_an_unknown_key_and_a_masters_layout_its_settings_do_not_give():
    data = Recipe.build("bf16-true").to_dict()
    with pytest.raises(ConfigError, match="unknown recipe key 'moment' \\(did you mean 'moments'"):
        Recipe.from_dict({**data, "moment": "int8"})
    with pytest.raises(ConfigError, match="masters=full but its settings give split"):
        Recipe.from_dict({**data, "masters": "full"})


def test_auto_with_an_fp16_params_optimizer_is_decided_when_the_recipe_is_built():
    model = Regressor()
    opt = mp.optim.AdamW(model.parameters(), lr=1e-3, fp16_params=True)
    auto = Recipe.build("auto", device="cpu")
    recipe = Recipe.build("auto", device="cpu", optimizer=opt)
    assert recipe.name == "16-true" and recipe.resolved_from == auto.name
    assert recipe.notes and "fp16_params=True" in recipe.notes[0]
    with pytest.raises(ConfigError, match="precision 'bf16-mixed' keeps fp32 parameters; use "
                                          "precision '16-true'"):
        Recipe.build("bf16-mixed", optimizer=opt)


def test_a_precision_is_built_from_a_recipe_and_never_changes_its_mode():
    recipe = Recipe.build("bf16-true", moments="int8")
    p = mp.Precision(recipe)
    assert p.recipe is recipe and p.policy is recipe.policy and p.name == "bf16-true"
    assert mp.Precision("bf16-true", moments="int8").recipe == recipe     # the arguments build one
    with pytest.raises(AttributeError):
        p.policy = mp.get_policy("16-true")
    with pytest.raises(AttributeError):
        p.recipe = Recipe.build("16-true")
    assert not hasattr(p, "reconcile_with_optimizer")
    with pytest.raises(ConfigError, match="build the recipe with moments="):
        mp.Precision(recipe, moments="bf16")


def test_make_optimizer_takes_the_recipes_moments_and_master_layout():
    model = mp.Precision("bf16-true").setup_module(nn.Sequential(nn.Linear(32, 32)))
    groups = [{"params": list(model.parameters())}]
    p = mp.Precision("bf16-true", moments="bf16", split_masters=False)
    opt = p.make_optimizer(groups, model=model)
    assert not opt.split_count
    assert any("Adam moments stored in bf16" in n for n in p.notes)
    split = mp.Precision("bf16-true")
    assert split.make_optimizer([{"params": list(model.parameters())}], model=model).split_count


def test_fit_config_builds_the_recipe_fit_runs_with(tmp_path):
    cfg = FitConfig(precision="16-mixed", moments="bf16", init_scale=512.0, fp8_activations=True,
                    precision_overrides={"net": "fp32"})
    trainer = mp.Trainer(Regressor(), config=cfg, run_dir=str(tmp_path / "r"))
    assert trainer.precision.recipe == cfg.recipe(device=trainer.device)
    assert trainer.precision.recipe.moments == "bf16" and trainer.precision.recipe.fp8_activations


def test_config_toml_records_the_recipe_and_a_resume_rebuilds_the_same_one(tmp_path):
    run = tmp_path / "run"
    mp.fit(Regressor(), _data(), precision="16-mixed", moments="bf16", init_scale=512.0,
           precision_overrides={"net": "fp32"}, max_steps=2, progress=False, audit=False,
           run_dir=str(run))
    text = (run / "config.toml").read_text()
    recorded = Recipe.from_toml(text)
    assert recorded.name == "16-mixed" and recorded.moments == "bf16"
    assert recorded.scaler_options["init_scale"] == 512.0
    assert recorded.policy.overrides == (("net", "fp32"),)
    assert "model" not in mp.runs.read_run_config(run).get("overrides", {})   # before the tables
    cfg, _ = load_config(run / "config.toml")     # what `mixprec train --resume` reads back
    assert cfg.recipe(device="cpu") == recorded


def test_a_ready_precision_refuses_a_fit_setting_that_would_change_its_recipe(tmp_path):
    with pytest.raises(ConfigError, match="moments='int8' would change the ready Precision"
                                          "\\('bf16-true'\\), whose moments is 'fp32'"):
        mp.fit(Regressor(), _data(), mixed_precision=mp.Precision("bf16-true"), moments="int8",
               max_steps=1, progress=False, audit=False, run_dir=str(tmp_path / "r"))


@pytest.mark.parametrize("split", [False, True])
def test_your_own_optimizer_gets_the_recipes_master_layout(split):
    # split_masters=False was ignored for an optimizer you pass (found writing docs/ARCHITECTURE.md's
    # walk): the recipe and config.toml said "full" while the step kept split masters.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    precision = mp.Precision("bf16-true", split_masters=split)
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert precision.recipe.masters == ("split" if split else "full")
    assert type(opt).__name__ == ("SplitMasterWeights" if split else "MasterWeights")
    assert (opt.split_count > 0) is split
