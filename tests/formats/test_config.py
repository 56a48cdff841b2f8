"""Fp8Config: named recipes, overrides, and invalid combinations failing with the fix."""
import pytest
import torch

from mixprec.errors import ConfigError
from mixprec.formats import Fp8Config
from mixprec.precision import FP8_RECIPES, get_policy


@pytest.mark.parametrize("name", ["tensorwise", "delayed", "rowwise", "blockwise", "fp8-blockwise"])
def test_every_recipe_builds_and_describes_itself(name):
    cfg = Fp8Config.from_recipe(name)
    assert cfg.recipe == name.removeprefix("fp8-")
    assert cfg.describe().startswith(f"fp8-{cfg.recipe}")


def test_blockwise_recipe_is_deepseek_granularity():
    cfg = Fp8Config.from_recipe("blockwise")
    assert cfg.activation_block == (1, 128) and cfg.weight_block == (128, 128)
    assert cfg.forward_dtype == cfg.grad_dtype == torch.float8_e4m3fn


def test_hybrid_format_uses_e5m2_for_gradients_only():
    cfg = Fp8Config.from_recipe("tensorwise")
    assert cfg.format == "hybrid"
    assert cfg.forward_dtype == torch.float8_e4m3fn and cfg.grad_dtype == torch.float8_e5m2


def test_config_is_frozen_and_keyword_only():
    cfg = Fp8Config.from_recipe("rowwise")
    with pytest.raises(Exception):
        cfg.margin = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        Fp8Config("rowwise")  # type: ignore[misc]


def test_unknown_recipe_suggests_the_closest_name():
    with pytest.raises(ConfigError, match="did you mean 'blockwise'"):
        Fp8Config.from_recipe("blockwse")


@pytest.mark.parametrize("changes, fix", [
    ({"format": "e4m2"}, "valid: e4m3, e5m2, hybrid"),
    ({"scaling": "blockwise", "activation_block": (128, 128)}, "use \\(1, 128\\)"),
    ({"weight_block": (0, 128)}, "two positive ints"),
    ({"amax_history_len": 0}, ">= 1"),
    ({"margin": -1}, ">= 0"),
    ({"accum_mantissa_bits": 30}, "1..23"),
    ({"accum_mantissa_bits": 14, "backend": "scaled-mm"}, "backend='emulated'"),
    ({"promotion_interval": 100}, "multiple of accum_chunk"),
    ({"format": "e5m2", "backend": "scaled-mm"}, "format='hybrid'"),
    ({"backend": "cuda"}, "valid: auto, scaled-mm, emulated"),
    ({"amax_compute": "mean"}, "max, most_recent"),
])
def test_invalid_combinations_fail_at_construction_with_the_fix(changes, fix):
    with pytest.raises(ConfigError, match=fix):
        Fp8Config.from_recipe("tensorwise", **changes)


def test_replace_validates_and_marks_custom():
    cfg = Fp8Config.from_recipe("blockwise").replace(high_precision_wgrad=True)
    assert cfg.recipe == "custom" and cfg.high_precision_wgrad
    with pytest.raises(ConfigError):
        cfg.replace(margin=-2)


@pytest.mark.parametrize("name", FP8_RECIPES)
def test_fp8_policies_resolve(name):
    pol = get_policy(name)
    assert pol.name == name and pol.fp8_recipe == name.removeprefix("fp8-")
    assert pol.param_dtype == torch.float32 and pol.compute_dtype == torch.bfloat16
    Fp8Config.from_recipe(pol.fp8_recipe)  # the trainer's call works for every registered policy
