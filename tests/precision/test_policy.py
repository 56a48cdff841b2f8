"""Policy presets, aliases, compact grammar, validation, module casting and autocast."""
import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.precision import PRESETS, cast_module, format_info, get_policy, parse_dtype
from mixprec.policy import policy as policy_mod

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize("name, dtypes, scaling, masters", [
    ("32-true", (F32, F32, F32, F32), False, False),
    ("tf32", (F32, F32, F32, F32), False, False),
    ("bf16-mixed", (F32, BF16, F32, F32), False, False),
    ("16-mixed", (F32, F16, F32, F32), True, False),
    ("bf16-true", (BF16, BF16, BF16, F32), False, True),
    ("16-true", (F16, F16, F16, F32), True, True),
])
def test_presets_have_documented_dtypes(name, dtypes, scaling, masters):
    p = get_policy(name)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype, p.reduce_dtype) == dtypes
    assert p.loss_scaling is scaling
    assert p.master_weights is masters
    assert p.name == name


@pytest.mark.parametrize("alias, preset", [
    ("fp32", "32-true"), ("no", "32-true"), ("bf16", "bf16-mixed"), ("fp16", "16-mixed"),
    ("mixed_float16", "16-mixed"), ("mixed_bfloat16", "bf16-mixed"), ("FP16", "16-mixed"),
    (" bf16-mixed ", "bf16-mixed"), (False, "32-true"), (None, "32-true"),
])
def test_aliases_resolve_to_presets(alias, preset):
    assert get_policy(alias) is PRESETS[preset]


def test_tf32_policy_enables_tf32_only_inside_autocast():
    before = torch.backends.cuda.matmul.allow_tf32
    with mp.autocast("tf32"):
        assert torch.backends.cuda.matmul.allow_tf32 is True
    assert torch.backends.cuda.matmul.allow_tf32 is before


def test_compact_grammar_matches_presets_and_builds_custom_policies():
    assert get_policy("p=f32,c=bf16,o=f32") is PRESETS["bf16-mixed"]
    assert get_policy("params=float32,compute=float16") is PRESETS["16-mixed"]
    custom = get_policy("p=f32,c=bf16,o=bf16,r=bf16")
    assert custom.name == "custom"
    assert (custom.output_dtype, custom.reduce_dtype) == (BF16, BF16)
    assert str(custom) == "p=f32,c=bf16,o=bf16,r=bf16"


def test_compact_grammar_rejects_unknown_keys_and_dtypes():
    with pytest.raises(ValueError, match="keys p .params., c .compute."):
        get_policy("x=f32")
    with pytest.raises(ValueError, match="unknown dtype 'bf61'.*did you mean 'bf16'"):
        get_policy("p=f32,c=bf61")


def test_unknown_name_lists_valid_names_and_closest_match():
    with pytest.raises(ValueError) as e:
        get_policy("bf61-mixed")
    msg = str(e.value)
    assert "did you mean 'bf16-mixed'" in msg
    for name in ("32-true", "bf16-mixed", "16-mixed", "bf16-true"):
        assert name in msg
    assert "\n" not in msg


def test_mixing_two_16_bit_formats_is_rejected():
    with pytest.raises(ValueError, match="two 16-bit formats"):
        mp.Policy(param_dtype=F16, compute_dtype=BF16)


def test_fp8_dtype_is_not_a_param_dtype():
    with pytest.raises(ValueError, match="fp8_recipe"):
        mp.Policy(param_dtype=torch.float8_e4m3fn)


def test_true_picks_the_best_safe_mode_for_the_hardware(monkeypatch):
    monkeypatch.setattr(policy_mod.hardware, "cpu_has_native_bf16", lambda: True)
    assert get_policy(True, device="cpu") is PRESETS["bf16-mixed"]
    monkeypatch.setattr(policy_mod.hardware, "cpu_has_native_bf16", lambda: False)
    # BF16 GEMMs are emulated on such CPUs (far slower than FP32): FP32 is the safe, fast choice.
    assert get_policy(True, device="cpu") is PRESETS["32-true"]
    monkeypatch.setattr(policy_mod.hardware, "cuda_supports_bf16", lambda: False)
    assert get_policy(True, device="cuda") is PRESETS["16-mixed"]
    monkeypatch.setattr(policy_mod.hardware, "cuda_supports_bf16", lambda: True)
    assert get_policy(True, device="cuda") is PRESETS["bf16-mixed"]


def test_policy_is_frozen():
    with pytest.raises(Exception):
        PRESETS["32-true"].compute_dtype = BF16  # type: ignore[misc]


class _Gate(nn.Linear):
    keep_in_fp32 = True


def test_cast_module_keeps_norms_flagged_modules_and_named_patterns_in_fp32():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), _Gate(4, 2), nn.Linear(2, 2))
    policy = get_policy("bf16-true").replace(keep_fp32_names=("3",))
    cast_module(model, policy)
    assert model[0].weight.dtype == BF16
    assert model[1].weight.dtype == F32          # norm type
    assert model[2].weight.dtype == F32          # keep_in_fp32 attribute
    assert model[3].weight.dtype == F32          # name pattern


def test_autocast_applies_compute_dtype_and_fp32_means_fp32():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with mp.autocast("bf16-mixed", device_type="cpu"):
        assert (a @ b).dtype == BF16
        with mp.autocast("32-true", device_type="cpu"):
            assert (a @ b).dtype == F32
    assert (a @ b).dtype == F32


def test_format_info_matches_ieee_facts():
    f16 = format_info("fp16")
    assert f16.max == 65504.0 and f16.tiny == 2.0 ** -14 and f16.smallest_subnormal == 2.0 ** -24
    assert format_info("e4m3").max == 448.0 and format_info("e5m2").max == 57344.0
    assert format_info(BF16).mantissa_bits == 7
    assert parse_dtype("half") is F16


@pytest.mark.parametrize("alias", ["fp16-mixed", "FP16-Mixed"])
def test_fp16_mixed_is_an_alias_of_16_mixed_like_fp16_true(alias):
    assert get_policy(alias) is PRESETS["16-mixed"]
    assert get_policy("fp16-true") is PRESETS["16-true"]


@pytest.mark.parametrize("typo, hint", [
    ("fp16-mixd", "fp16-mixed"), ("fp16mixed", "fp16-mixed"), ("fp16-tru", "fp16-true"),
    ("bf16-mixd", "bf16-mixed"), ("bf61", "bf16"), ("fp32-true", "32-true"),
])
def test_did_you_mean_stays_within_the_typed_number_format(typo, hint):
    with pytest.raises(ValueError, match=f"did you mean '{hint}'"):
        get_policy(typo)


def test_did_you_mean_for_bare_fp8_lists_the_fp8_recipes_not_mxfp8():
    with pytest.raises(ValueError) as e:
        get_policy("fp8")
    hint = str(e.value).split(";")[0]
    assert "mxfp8" not in hint
    for recipe in ("fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "fp8-blockwise"):
        assert recipe in hint


@pytest.mark.parametrize("typo", ["fp16-mixd", "fp16mixed", "half-mixd", "float16-mixed", "f16mixed"])
def test_an_fp16_typo_never_suggests_a_bf16_mode(typo):
    with pytest.raises(ValueError) as e:
        get_policy(typo)
    assert "bf16" not in str(e.value).split(";")[0]
