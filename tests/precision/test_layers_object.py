"""``Precision.layers``: one object, built from the frozen recipe, answers every per-layer question
and holds the live formats of the model it set up; the recipe answers its format questions."""
import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.policy.dtypes import FP8_E4M3, FP8_E5M2
from mixprec.precision.layers import Layers
from mixprec.precision.recipe import Recipe

ROOT = Path(mp.__file__).parent


def _model() -> nn.Module:
    torch.manual_seed(0)
    return mp.Transformer.from_preset("tiny", num_layers=2)


def test_the_layers_of_a_precision_are_built_from_its_recipe():
    precision = mp.Precision("bf16-mixed", overrides={"head": "fp32"})
    assert isinstance(precision.layers, Layers) and precision.layers.recipe is precision.recipe
    assert precision.layers.formats == {} and precision.layers.table is None
    assert precision.layers.fp8_report is None and precision.layers.micro_report is None


@pytest.mark.parametrize("mode, overrides", [("bf16-true", None), ("fp8-tensorwise", None), ("nvfp4", None),
                                             ("32-true", {"blocks.1.*": "fp8-blockwise", "head": "bf16"})])
def test_layers_alone_set_a_model_up_as_the_precision_does(mode, overrides):
    """No Precision is needed: the formats, the reports and the table of Layers(recipe) on its
    own are those of Precision.setup (no back-reference from the module surgery)."""
    precision = mp.Precision(mode, overrides=overrides, device="cpu")
    model, _ = precision.setup(_model())
    layers, other = Layers(Recipe.build(mode, device="cpu", overrides=overrides)), _model()
    mp.precision.cast_module(other, layers.recipe.policy, dtype_for=layers.param_dtype_for)
    layers.apply(other)
    assert layers.formats == precision.layers.formats
    assert str(layers.fp8_report) == str(precision.layers.fp8_report)
    assert str(layers.micro_report) == str(precision.layers.micro_report)
    assert layers.resolve(other) == precision.layers.table == precision.resolve(model)
    assert precision.describe(model) == str(precision.layers.table)


def test_the_module_surgery_imports_no_precision():
    tree = ast.parse((ROOT / "precision" / "layers.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "mixprec.precision.precision" not in imported and "mixprec.precision.layer_formats" not in imported
    assert not (ROOT / "precision" / "layer_formats.py").exists()


def test_a_switch_while_training_is_seen_and_a_restore_undoes_it():
    precision = mp.Precision("bf16-mixed", device="cpu")
    model, _ = precision.setup(_model())
    layers = precision.layers
    assert not layers.switched and layers.ran() == "bf16-mixed"
    assert layers.set_format(model, "blocks.0.mlp.fc", "fp32") == "fp32"
    assert layers.switched and layers.ran() == "bf16-mixed+switched (8 bf16, 1 fp32)"
    assert layers.table["blocks.0.mlp.fc"].compute == "fp32"           # the table follows the switch
    layers.restore(model, {"blocks.0.mlp.fc": "bf16"})
    assert not layers.switched and type(model.blocks[0].mlp.fc) is nn.Linear
    assert layers.table["blocks.0.mlp.fc"].compute == "bf16"


def test_the_describe_line_counts_the_layers_after_setup():
    precision = mp.Precision("32-true", overrides={"head": "bf16"}, device="cpu")
    line = precision.describe()
    assert line == precision.policy.describe()
    model, _ = precision.setup(_model())
    assert precision.describe() == f"{line}; Linear layers: 8 fp32, 1 bf16"
    assert precision.layers.describe_lines()[-1] == f"{'head':<{len('blocks.0.attn.proj')}}  bf16"


def test_peak_format_is_the_recipes_until_a_narrower_layer_runs():
    precision = mp.Precision("32-true", overrides={"blocks.0.mlp.fc": "nvfp4"}, device="cpu")
    assert precision.layers.peak_format == precision.recipe.matmul_format == "fp32"
    precision.setup(_model())
    assert precision.layers.peak_format == "fp4"


def test_range_formats_follow_the_format_each_layer_runs():
    precision = mp.Precision("bf16-mixed", overrides={"blocks.0.mlp.fc": "fp8-tensorwise",
                                                     "blocks.1.mlp.fc": "fp32"}, device="cpu")
    ranges = precision.layers.range_formats(_model())
    assert ranges["blocks.0.mlp.fc"] == (FP8_E4M3, FP8_E5M2)
    assert ranges["blocks.1.mlp.fc"] == (torch.float32, torch.float32)
    assert ranges["blocks.0.ln1"] == ranges["wte"] == (torch.bfloat16, torch.bfloat16)   # the mode's


@pytest.mark.parametrize("mode, expected", [
    # matmul, base, default, uses_fp8, activation, gradient, fp8_recipe
    ("32-true", ("fp32", "fp32", "fp32", False, torch.float32, torch.float32, None)),
    ("bf16-mixed", ("bf16", "bf16", "bf16", False, torch.bfloat16, torch.bfloat16, None)),
    ("16-true", ("fp16", "fp16", "fp16", False, torch.float16, torch.float16, None)),
    ("fp8-delayed", ("fp8", "bf16", "fp8-delayed", True, FP8_E4M3, FP8_E5M2, "delayed")),
    ("mxfp8", ("fp8", "bf16", "mxfp8", False, torch.bfloat16, torch.bfloat16, None)),
    ("nvfp4", ("fp4", "bf16", "nvfp4", False, torch.bfloat16, torch.bfloat16, None)),
])
def test_the_recipe_answers_the_modes_format_questions(mode, expected):
    r = Recipe.build(mode, device="cpu")
    assert (r.matmul_format, r.base_format, r.default_format, r.uses_fp8, r.activation_format,
            r.gradient_format, r.fp8_recipe) == expected
    assert not r.has_plan and r.label == r.name == mode


def test_an_override_makes_a_plan_and_may_use_fp8():
    r = Recipe.build("32-true", overrides={"head": "fp8-blockwise"}, device="cpu")
    assert r.has_plan and r.label == "32-true+plan" and r.uses_fp8 and r.fp8_recipe is None
    assert r.matmul_format == "fp32" and r.default_format == r.base_format == "fp32"   # the mode's


def test_the_classes_stay_small():
    """#38: the per-layer object under 200 lines, the recipe under 250."""
    tree = {n.name: n for f in ("layers.py", "recipe.py")
            for n in ast.parse((ROOT / "precision" / f).read_text()).body if isinstance(n, ast.ClassDef)}
    assert tree["Layers"].end_lineno - tree["Layers"].lineno < 200
    assert tree["Recipe"].end_lineno - tree["Recipe"].lineno < 250
