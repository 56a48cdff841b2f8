"""Per-layer precision: overrides in the policy and the Precision, each Linear in its own format."""
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec.estimate.memory import ModelShape, estimate_memory
from mixprec.errors import CheckpointError, ConfigError
from mixprec.formats import Fp8Linear
from mixprec.nn import FormatLinear
from mixprec.train.config import TrainConfig, config_to_toml, load_config


def _model() -> nn.Module:
    torch.manual_seed(0)
    return mp.models.Transformer(num_layers=2, d_model=32, num_heads=4, max_seq_len=16, dropout=0.0)


def test_first_matching_pattern_wins():
    specific_first = mp.Precision("bf16-mixed", overrides=(("blocks.0.mlp.fc", "fp32"), ("blocks.0.*", "fp16")))
    broad_first = mp.Precision("bf16-mixed", overrides=(("blocks.0.*", "fp16"), ("blocks.0.mlp.fc", "fp32")))
    assert specific_first.layers.requested_format("blocks.0.mlp.fc") == "fp32"
    assert specific_first.layers.requested_format("blocks.0.attn.qkv") == "fp16"
    assert broad_first.layers.requested_format("blocks.0.mlp.fc") == "fp16"
    assert specific_first.layers.requested_format("blocks.1.mlp.fc") == "bf16"   # no match: the mode's


def test_a_parent_name_covers_its_layers_and_dict_order_is_kept():
    p = mp.Precision("32-true", overrides={"blocks.1": "bf16", "head": "bf16"})
    assert p.policy.overrides == (("blocks.1", "bf16"), ("head", "bf16"))
    assert p.layers.requested_format("blocks.1.attn.qkv") == "bf16"
    assert p.layers.requested_format("blocks.10.attn.qkv") == "fp32"


def test_unknown_pattern_names_the_closest_layer():
    with pytest.raises(ConfigError, match=r"'blocks.0.mlpp.fc' matches no Linear.*did you mean 'blocks.0.mlp.fc'"):
        mp.Precision("bf16-mixed", overrides={"blocks.0.mlpp.fc": "fp32"}).setup(_model())


def test_unknown_format_is_refused_with_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown layer format 'bf61'.*did you mean 'bf16'"):
        mp.Precision("bf16-mixed", overrides={"head": "bf61"})


def test_formats_per_layer_after_setup():
    p = mp.Precision("fp8-blockwise", overrides=(("blocks.0.mlp.fc", "fp32"), ("blocks.0.*", "bf16"),
                                                 ("blocks.1.attn.qkv", "fp8-tensorwise")))
    model, _ = p.setup(_model())
    b0, b1 = model.blocks[0], model.blocks[1]
    assert type(b0.mlp.fc) is FormatLinear and b0.mlp.fc.compute_format == "fp32"
    assert type(b0.attn.qkv) is nn.Linear                         # bf16 = the mode's non-FP8 format
    assert isinstance(b1.attn.qkv, Fp8Linear) and b1.attn.qkv.config.recipe == "tensorwise"
    assert isinstance(b1.mlp.fc, Fp8Linear) and b1.mlp.fc.config.recipe == "blockwise"
    assert p.layers.formats == {
        "blocks.0.attn.qkv": "bf16", "blocks.0.attn.proj": "bf16", "blocks.0.mlp.fc": "fp32",
        "blocks.0.mlp.proj": "bf16", "blocks.1.attn.qkv": "fp8-tensorwise",
        "blocks.1.attn.proj": "fp8-blockwise", "blocks.1.mlp.fc": "fp8-blockwise",
        "blocks.1.mlp.proj": "fp8-blockwise", "head": "bf16"}    # the tied head never goes FP8
    assert "1 fp32" in p.describe()
    assert "blocks.0.mlp.fc     fp32" in p.layers.describe_lines()
    findings = mp.monitor.audit(model, precision=p)
    assert any(f.code == "layer-formats" and "blocks.0.mlp.fc=fp32" in f.message for f in findings)


def test_fp32_layer_runs_fp32_inside_bf16_autocast_and_bf16_layer_inside_fp32_model():
    torch.manual_seed(0)
    x = torch.randn(8, 32)
    lin = nn.Linear(32, 16)
    ref = F.linear(x.double(), lin.weight.double(), lin.bias.double())
    fp32 = FormatLinear.from_linear(lin, "fp32")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp32(x.bfloat16())
    assert y.dtype == torch.float32
    # Input rounded to bf16 by the caller; the GEMM itself is FP32 (relative error ~1e-7, not ~1e-3).
    exact = F.linear(x.bfloat16().double(), lin.weight.double(), lin.bias.double())
    assert torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-6)
    bf16 = FormatLinear.from_linear(lin, "bf16")
    y16 = bf16(x)                                      # no autocast around: output back in FP32
    assert y16.dtype == torch.float32
    err = (y16.double() - ref).abs().max().item()
    assert 1e-5 < err < 5e-2                            # rounded to bf16 (8 bits), not exact


def test_fp32_override_keeps_fp32_params_in_a_16bit_mode_and_fp16_turns_on_scaling():
    p = mp.Precision("bf16-true", overrides={"head": "fp32", "blocks.0.mlp.fc": "fp32"})
    model, _ = p.setup(_model())
    assert model.blocks[0].mlp.fc.weight.dtype == torch.float32
    assert model.blocks[1].mlp.fc.weight.dtype == torch.bfloat16
    assert not mp.Precision("bf16-mixed").recipe.scales_loss
    assert mp.Precision("bf16-mixed", overrides={"head": "fp16"}).recipe.scales_loss


def test_per_layer_training_step_is_finite_and_matches_fp32_closely():
    x = torch.randint(0, 256, (4, 16))

    def loss_of(prec):
        model, _ = prec.setup(_model())
        with prec.autocast():
            _, loss = model(x, x)
        loss.backward()
        return loss.item(), model.blocks[0].mlp.fc.weight.grad

    ref, gref = loss_of(mp.Precision("32-true"))
    mixed, g = loss_of(mp.Precision("fp8-tensorwise", overrides={"blocks.0.*": "fp32"}))
    assert abs(mixed - ref) / ref < 0.01                      # FP8 elsewhere: within 1 % of FP32
    assert g.dtype == torch.float32 and torch.isfinite(g).all()


def test_memory_estimator_counts_each_layer_in_its_format():
    shape = ModelShape(num_layers=2, d_model=64, num_heads=4, vocab_size=256, max_seq_len=64)
    kw = dict(batch=4, seq=64)
    bf16 = estimate_memory(shape, "bf16-mixed", **kw)
    fp32 = estimate_memory(shape, "32-true", **kw)
    mixed = estimate_memory(shape, mp.Precision("bf16-mixed", overrides={"blocks.0": "fp32"}), **kw)
    d, r = 64, 4
    one_block_weights = 4 * d * d + 2 * r * d * d
    assert mixed.weight_copies == bf16.weight_copies - 2 * one_block_weights     # no copy for FP32
    saved_inputs = 3 * d + r * d                              # qkv, proj, fc, mlp.proj inputs
    assert mixed.activations - bf16.activations == 4 * 64 * (4 - 2) * saved_inputs
    assert bf16.activations < mixed.activations < fp32.activations
    true_mixed = estimate_memory(shape, mp.Precision("bf16-true", overrides={"blocks.0": "fp32"}), **kw)
    true_all = estimate_memory(shape, "bf16-true", **kw)
    kept_fp32 = one_block_weights + 3 * d + d + r * d + d    # blocks.0's parameters are their own masters
    # Split masters (the default) cost 2 extra bytes per BF16 parameter; full FP32 masters cost 4.
    assert true_mixed.master_weights == true_all.master_weights - 2 * kept_fp32
    full_mixed = estimate_memory(shape, mp.Precision("bf16-true", overrides={"blocks.0": "fp32"}),
                                 split_masters=False, **kw)
    full_all = estimate_memory(shape, "bf16-true", split_masters=False, **kw)
    assert full_mixed.master_weights == full_all.master_weights - 4 * kept_fp32


def test_toml_overrides_table_and_command_line(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('precision = "fp8-blockwise"\nmax_steps = 5\n[overrides]\n"head" = "bf16"\n'
                 '"blocks.0.*" = "fp32"\n[optim]\nlr = 1e-3\n')
    cfg, source = load_config(f)
    assert cfg.precision_overrides == (("head", "bf16"), ("blocks.0.*", "fp32")) and cfg.lr == 1e-3
    again = tmp_path / "saved.toml"
    again.write_text(config_to_toml(cfg))
    assert load_config(again)[0].precision_overrides == cfg.precision_overrides
    cli, _ = load_config(None, {"precision_overrides": "head=bf16,blocks.0.*=fp32"})
    assert cli.precision_overrides == cfg.precision_overrides
    with pytest.raises(ConfigError, match="unknown layer format"):
        TrainConfig(precision_overrides={"head": "fp9"})


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_plan_file_is_a_precision(tmp_path, suffix):
    from mixprec.policy.overrides import write_plan
    path = write_plan(tmp_path / f"plan{suffix}", "fp8-blockwise",
                      (("blocks.1.*", "bf16"), ("blocks.0.mlp.fc", "fp32")))
    policy = mp.get_policy(f"plan:{path}")
    assert policy.fp8_recipe == "blockwise" and policy.name == "fp8-blockwise"
    assert policy.overrides == (("blocks.1.*", "bf16"), ("blocks.0.mlp.fc", "fp32"))
    with pytest.raises(ConfigError, match="plan file not found"):
        mp.get_policy(f"plan:{tmp_path / 'missing.json'}")


def test_fit_logs_formats_and_resume_refuses_other_overrides(tmp_path):
    x = torch.randint(0, 256, (16, 16))
    loader = [(x[i:i + 4], x[i:i + 4]) for i in range(0, 16, 4)]
    run = tmp_path / "run"
    kw = dict(max_steps=2, run_dir=str(run), progress=False, audit=False, lr=1e-3)
    mp.train.fit(_model(), loader, mixed_precision="32-true",
                 precision_overrides={"blocks.0.*": "bf16"}, **kw)
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    formats = next(e for e in events if e["kind"] == "formats")["layers"]
    assert formats["blocks.0.mlp.fc"] == "bf16" and formats["blocks.1.mlp.fc"] == "fp32"
    with pytest.raises(CheckpointError, match="per-layer overrides"):
        mp.train.fit(_model(), loader, mixed_precision="32-true", resume=run,
                     **{**kw, "max_steps": 3})


def test_auto_switching_to_a_true_mode_keeps_the_overrides():
    model = _model()
    optimizer = mp.optim.AdamW(model.parameters(), fp16_params=True, param_dtype=torch.bfloat16)
    p = mp.Precision("auto", overrides={"head": "fp32"}, optimizer=optimizer)
    model, _ = p.setup(model, optimizer)
    assert p.name == "bf16-true" and p.policy.overrides == (("head", "fp32"),)
    assert p.layers.formats["head"] == "fp32"


@pytest.mark.parametrize("mode, overrides", [
    ("fp8-blockwise", ()),                          # convert_to_fp8
    ("bf16-mixed", (("0", "fp32"),)),               # FormatLinear
    ("bf16-mixed", (("0", "fp8-tensorwise"),)),     # one FP8 layer in a BF16 run
])
def test_hooks_on_a_swapped_linear_keep_running_and_stay_removable(mode, overrides):
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    seen = []
    pre = model[0].register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    post = model[0].register_forward_hook(lambda mod, args, out: seen.append(type(mod).__name__))
    precision = mp.Precision(mode, overrides=overrides)
    model, _ = precision.setup(model)
    assert type(model[0]) is not nn.Linear
    x = torch.randn(4, 32)
    with precision.autocast():
        doubled = model[0](x)
    assert seen == [type(model[0]).__name__]
    pre.remove()
    post.remove()
    with precision.autocast():
        plain = model[0](x)
    assert seen == [type(model[0]).__name__]           # removed through the original handle
    torch.testing.assert_close(doubled.float() - model[0].bias.float(),
                               2 * (plain.float() - model[0].bias.float()), rtol=0.15, atol=0.05)


def test_hooks_survive_a_layer_switch_while_training():
    from torch import nn
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    calls = []
    model[0].register_forward_hook(lambda mod, args, out: calls.append(type(mod).__name__))
    precision = mp.Precision("bf16-mixed")
    model, _ = precision.setup(model)
    for fmt in ("fp8-tensorwise", "fp32", "bf16"):
        precision.layers.set_format(model, "0", fmt)
        with precision.autocast():
            model(torch.randn(2, 32))
    assert calls == ["Fp8Linear", "FormatLinear", "Linear"]
