"""The plugins that apply a recipe (mixprec.precision.plugins): which family answers which hook,
the optimizer chosen from ``recipe.masters``, the one loss scale, FSDP2's storage and policies."""
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.amp import GradScaler
from mixprec.optim import AdamW, MasterWeights
from mixprec.optim.split_masters import SplitMasterWeights
from mixprec.precision import Recipe
from mixprec.precision.plugins import (AutocastPlugin, FormatsPlugin, Fsdp2Plugin, ParamsPlugin,
                                       PrecisionPlugin, plugins_for)

HOOKS = ("convert_module", "forward_context", "convert_output", "scale_loss", "setup_optimizer",
         "make_optimizer", "mixed_precision", "island_policy", "state_dict", "load_state_dict")
PLUGINS = Path(mp.__file__).parent / "precision" / "plugins"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 8))


def test_every_family_is_a_plugin_with_the_base_hooks_and_stays_small():
    plugins = plugins_for(Recipe.build("bf16-true"))
    assert [type(p) for p in (plugins.autocast, plugins.params, plugins.formats, plugins.fsdp2)] == \
        [AutocastPlugin, ParamsPlugin, FormatsPlugin, Fsdp2Plugin]
    for p in (plugins.autocast, plugins.params, plugins.formats, plugins.fsdp2):
        assert isinstance(p, PrecisionPlugin) and all(callable(getattr(p, h)) for h in HOOKS)
    for path in PLUGINS.glob("*.py"):
        assert len(path.read_text().splitlines()) < 200, path.name


@pytest.mark.parametrize("sharded, first", [(False, ParamsPlugin), (True, Fsdp2Plugin)])
def test_storage_converts_before_the_formats_and_fsdp2_takes_the_storage_and_optimizer(sharded, first):
    plugins = plugins_for(Recipe.build("fp8-tensorwise"))
    assert [type(p) for p in plugins.converting(sharded=sharded)] == [first, FormatsPlugin]
    assert type(plugins.optimizing(sharded=sharded)) is first


@pytest.mark.parametrize("mode, split_masters, kind, splits", [
    ("bf16-true", True, AdamW, True),        # masters = split: the BF16 parameter + a remainder
    ("bf16-true", False, AdamW, False),      # masters = full: FP32 copies
    ("16-true", True, AdamW, False),         # FP16 parameters: full (nothing to split)
    ("32-true", True, AdamW, False),         # FP32 parameters: no master at all
])
def test_the_params_plugin_builds_the_layout_the_recipe_says(mode, split_masters, kind, splits):
    precision = mp.Precision(mode, device="cpu", split_masters=split_masters)
    model = precision.setup_module(_model())
    opt = precision.make_optimizer([{"params": list(model.parameters())}], model=model)
    assert type(opt) is kind and bool(opt.split_count) is splits
    assert precision.recipe.masters == ("split" if splits else "none" if mode == "32-true" else "full")
    assert opt.master_of(model[0].weight).dtype == torch.float32        # the exact value, every layout


def test_without_masters_the_params_plugin_builds_torchs_adamw():
    precision = mp.Precision(mp.get_policy("bf16-true").replace(master_weights=False), device="cpu")
    model = precision.setup_module(_model())
    assert precision.recipe.masters == "none" and precision.recipe.loses_small_updates
    assert type(precision.make_optimizer([{"params": list(model.parameters())}], model=model)) is torch.optim.AdamW


@pytest.mark.parametrize("mode, split_masters, wrapped", [
    ("bf16-true", True, SplitMasterWeights), ("bf16-true", False, MasterWeights),
    ("16-true", True, MasterWeights), ("bf16-mixed", True, torch.optim.SGD)])
def test_a_users_optimizer_is_wrapped_in_the_recipes_layout(mode, split_masters, wrapped):
    precision = mp.Precision(mode, device="cpu", split_masters=split_masters)
    model, opt = precision.setup(_model(), torch.optim.SGD(_model().parameters(), lr=0.1))
    model, opt = precision.setup(_model(), lambda params: torch.optim.SGD(params, lr=0.1))
    assert type(opt) is wrapped


@pytest.mark.parametrize("mode, scaled_by", [("16-mixed", "autocast"), ("16-true", "params"),
                                             ("bf16-mixed", None), ("32-true", None)])
def test_exactly_one_family_scales_the_loss(mode, scaled_by):
    plugins = plugins_for(Recipe.build(mode))
    scaler = GradScaler("cpu", init_scale=8.0, enabled=plugins.params.recipe.scales_loss)
    loss = torch.tensor(3.0)
    scaled = {p.name: p.scale_loss(loss, scaler).item() for p in (plugins.autocast, plugins.params)}
    assert {n for n, v in scaled.items() if v != 3.0} == ({scaled_by} if scaled_by else set())
    assert plugins.scale_loss(loss, scaler).item() == (24.0 if scaled_by else 3.0)


def test_the_forward_context_is_autocast_in_the_compute_dtype_and_the_output_is_cast():
    plugins = plugins_for(Recipe.build("bf16-mixed"))
    with plugins.forward_context("cpu"):
        y = nn.Linear(4, 4)(torch.randn(2, 4))
    assert y.dtype == torch.bfloat16 and plugins.convert_output(y).dtype == torch.float32
    with plugins_for(Recipe.build("32-true")).forward_context("cpu"), torch.autocast("cpu"):
        pass                                               # 32-true: a context too (autocast off)
    with torch.autocast("cpu", dtype=torch.bfloat16), plugins_for(Recipe.build("32-true")).forward_context("cpu"):
        assert nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.float32


@pytest.mark.parametrize("mode, casts", [("bf16-true", False), ("bf16-mixed", False)])
def test_fsdp2_leaves_the_fp32_shards_as_the_masters(mode, casts):
    precision = mp.Precision(mode, device="cpu")
    model = precision.setup_module(_model(), sharded=True)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert Fsdp2Plugin(precision.recipe).casts_before_sharding is casts
    opt = precision.make_optimizer([{"params": list(model.parameters())}], sharded=True)
    assert type(opt) is torch.optim.AdamW


def test_fsdp2_casts_a_mode_without_masters_before_sharding():
    precision = mp.Precision(mp.get_policy("bf16-true").replace(master_weights=False), device="cpu")
    model = precision.setup_module(_model(), sharded=True)
    assert Fsdp2Plugin(precision.recipe).casts_before_sharding
    assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32   # norm kept


@pytest.mark.parametrize("mode, gather, reduce, island", [
    ("32-true", None, None, False), ("bf16-mixed", torch.bfloat16, torch.float32, True),
    ("bf16-true", torch.bfloat16, torch.float32, True), ("16-mixed", torch.float16, torch.float32, True)])
def test_fsdp2_unit_policies(mode, gather, reduce, island):
    plugin = Fsdp2Plugin(Recipe.build(mode))
    mp_policy = plugin.mixed_precision()
    assert (mp_policy.param_dtype, mp_policy.reduce_dtype) == (gather, reduce)
    got = plugin.island_policy()
    assert (got is not None) is island
    if island:
        assert (got.param_dtype, got.output_dtype) == (torch.float32, gather)


def test_a_plugin_without_state_saves_nothing_and_the_precision_state_is_unchanged():
    precision = mp.Precision("16-mixed", device="cpu")
    plugins = plugins_for(precision.recipe)
    assert all(p.state_dict() == {} for p in (plugins.autocast, plugins.params, plugins.formats, plugins.fsdp2))
    assert set(precision.state_dict()) == {"policy", "name", "scaler", "overrides"}
