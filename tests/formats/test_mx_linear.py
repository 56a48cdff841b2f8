"""MicroLinear: each GEMM quantizes its operands along its reduction dimension; the NVFP4
recipe's options do what they say; the formats are usable wherever a format is accepted."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import mixprec
from mixprec.errors import ConfigError
from mixprec.formats import MicroConfig, MicroLinear, hadamard_matrix, quantize_mx, quantize_nvfp4
from mixprec.formats import sqnr_db
from mixprec.models import Transformer, get_model_config


def _layer(recipe: str, k: int = 64, n: int = 96, **opts) -> tuple[MicroLinear, nn.Linear]:
    torch.manual_seed(0)
    ref = nn.Linear(k, n)
    return MicroLinear.from_linear(ref, MicroConfig.from_recipe(recipe, **opts), fqn="l"), ref


def _run(layer: nn.Module, x: torch.Tensor, g: torch.Tensor):
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, layer.weight.grad.clone()


def test_mxfp8_gemms_quantize_along_their_reduction_dims_exactly():
    layer, _ = _layer("mxfp8")
    x, g = torch.randn(40, 64), torch.randn(40, 96)
    y, dx, dw = _run(layer, x, g)
    dq = lambda t: quantize_mx(t.contiguous(), "e4m3").dequantize()  # noqa: E731  blocks along rows
    w = layer.weight.detach()
    assert torch.equal(y, dq(x) @ dq(w).t() + layer.bias.detach())          # along K
    assert torch.equal(dx, dq(g) @ dq(w.t()).t())                             # along N
    assert torch.equal(dw, dq(g.t()) @ dq(x.t()).t())                         # along M (tokens)


def test_nvfp4_2d_weight_blocks_serve_forward_and_input_grad_alike():
    layer, _ = _layer("nvfp4", stochastic_grad=False, hadamard_wgrad=False)
    x, g = torch.randn(32, 64), torch.randn(32, 96)
    _, dx, _ = _run(layer, x, g)
    wq = quantize_nvfp4(layer.weight.detach(), block=(16, 16)).dequantize()
    gq = quantize_nvfp4(g).dequantize()
    assert torch.equal(dx, gq @ wq)


def test_hadamard_is_orthogonal_and_leaves_the_unquantized_product_unchanged():
    h = hadamard_matrix(16, seed=3)
    assert torch.allclose(h @ h.t(), torch.eye(16), atol=1e-6)
    assert not torch.equal(h, hadamard_matrix(16, seed=4))                     # random signs
    from mixprec.formats.mx_linear import _rotate
    a, b = torch.randn(8, 40), torch.randn(6, 40)                              # M=40: padded
    assert torch.allclose(_rotate(a, h) @ _rotate(b, h).t(), a @ b.t(), atol=1e-5)


def test_hadamard_wgrad_multiplies_the_rotated_operands_quantized_along_tokens():
    layer, _ = _layer("nvfp4", stochastic_grad=False)
    x, g = torch.randn(40, 64), torch.randn(40, 96)                            # 40 tokens: padded
    _, _, dw = _run(layer, x, g)
    from mixprec.formats.mx_linear import _rotate
    h = hadamard_matrix(16, seed=0)
    want = quantize_nvfp4(_rotate(g.t(), h)).dequantize() @ quantize_nvfp4(_rotate(x.t(), h)).dequantize().t()
    assert torch.equal(dw, want)
    assert sqnr_db(g.t() @ x, dw) > 14.0


def test_stochastic_rounding_of_gradients_changes_between_steps_nearest_does_not():
    x, g = torch.randn(32, 64), torch.randn(32, 96)
    sr, _ = _layer("nvfp4", hadamard_wgrad=False)
    rne, _ = _layer("nvfp4", hadamard_wgrad=False, stochastic_grad=False)
    assert not torch.equal(_run(sr, x, g)[1], _run(sr, x, g)[1])
    assert torch.equal(_run(rne, x, g)[1], _run(rne, x, g)[1])
    assert torch.equal(_run(sr, x, g)[0], _run(sr, x, g)[0])        # forward is always RNE


@pytest.mark.parametrize("recipe,min_db", [("mxfp8", 23.0), ("mxfp4", 13.0), ("nvfp4", 13.0)])
def test_outputs_and_gradients_stay_close_to_fp32(recipe, min_db):
    layer, ref = _layer(recipe)
    x, g = torch.randn(64, 64), torch.randn(64, 96)
    got, want = _run(layer, x, g), _run(ref, x, g)
    for a, b in zip(got, want):
        assert sqnr_db(b, a) > min_db
    assert layer.execution_path == "emulated" and "numerics" in layer.execution_reason


# --- wiring -----------------------------------------------------------------------------------

def _small():
    torch.manual_seed(0)
    return Transformer.from_config(get_model_config("small"))


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4", "nvfp4"])
def test_presets_resolve_and_report_their_layers(name):
    p = mixprec.Precision(name)
    assert p.policy.micro_format == name and p.recipe.compute_dtype == torch.bfloat16
    model = _small()
    p.setup(model)
    assert p.layers.micro_report.expected_path == "emulated"
    assert dict(p.layers.micro_report.skipped)["head"] == "output head tied to an embedding"
    assert p.layers.formats["blocks.0.mlp.fc"] == name
    assert isinstance(model.blocks[0].mlp.fc, MicroLinear)
    assert p.recipe.matmul_format == ("fp8" if name == "mxfp8" else "fp4")


def test_nvfp4_preset_keeps_the_last_blocks_in_bf16_an_explicit_override_wins():
    p = mixprec.Precision("nvfp4")
    p.setup(_small())
    assert {f for n, f in p.layers.formats.items() if n.startswith("blocks.3.")} == {"bf16"}
    assert "keeps the first 0 / last 1 of 4 blocks" in dict(p.layers.micro_report.skipped)["blocks.3.mlp.fc"]
    p = mixprec.Precision("nvfp4", overrides={"blocks.3.mlp.fc": "nvfp4"})
    p.setup(_small())
    assert p.layers.formats["blocks.3.mlp.fc"] == "nvfp4" and p.layers.formats["blocks.3.attn.qkv"] == "bf16"
    p = mixprec.Precision("nvfp4", micro_options="bf16_last=0,hadamard_wgrad=false")
    model = _small()
    p.setup(model)
    assert p.layers.formats["blocks.3.mlp.fc"] == "nvfp4"
    assert model.blocks[3].mlp.fc.config.hadamard_wgrad is False
    assert "micro=nvfp4(bf16_last=0,hadamard_wgrad=False)" in p.policy.spec()


def test_bad_micro_options_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="unknown micro-format option 'hadamard'"):
        mixprec.Precision("nvfp4", micro_options="hadamard=false")
    with pytest.raises(ConfigError, match="NVFP4 option"):
        mixprec.Precision("mxfp8", micro_options="weight_2d=true")
    with pytest.raises(ConfigError, match="true or false"):
        mixprec.Precision("nvfp4", micro_options="weight_2d=maybe")


def test_per_layer_micro_formats_in_overrides_plan_files_and_layer_switches(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"precision": "32-true",
                                "overrides": [["blocks.0.*", "mxfp4"], ["blocks.1.mlp.fc", "nvfp4"]]}))
    p = mixprec.Precision(f"plan:{plan}")
    model = _small()
    p.setup(model)
    assert p.layers.formats["blocks.0.attn.qkv"] == "mxfp4"
    assert p.layers.formats["blocks.1.mlp.fc"] == "nvfp4"       # explicit: not kept by the recipe
    assert p.layers.formats["blocks.2.mlp.fc"] == "fp32"
    assert p.layers.set_format(model, "blocks.2.mlp.fc", "mxfp8") == "mxfp8"
    assert isinstance(model.blocks[2].mlp.fc, MicroLinear)
    assert p.layers.set_format(model, "blocks.2.mlp.fc", "fp32") == "fp32"
    assert type(model.blocks[2].mlp.fc) is nn.Linear
    x = torch.randint(0, 256, (2, 32))
    loss = model(x, x)
    loss = loss.loss if hasattr(loss, "loss") else loss[-1] if isinstance(loss, tuple) else loss
    loss.backward()
    assert all(torch.isfinite(q.grad).all() for q in model.parameters() if q.grad is not None)


def test_layers_whose_features_miss_the_mx_block_are_kept_out():
    model = nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 64))
    p = mixprec.Precision("32-true", overrides={"*": "mxfp8"})
    p.setup(model)
    assert p.layers.formats == {"0": "fp32", "2": "mxfp8"}
    assert "multiples of its 32-element block" in dict(p.layers.micro_report.skipped)["0"]


def test_planner_takes_micro_candidates_at_blackwell_rates_and_drops_them_when_measuring_here():
    import torch.nn.functional as F
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    batches = [(torch.randn(16, 32), torch.randn(16, 32))]
    plan = mixprec.plan.plan_precision(model, batches, candidates=("fp32", "bf16", "mxfp8", "nvfp4"),
                                  target="B200", loss_fn=F.mse_loss, budget=0.5)
    assert plan.throughput["nvfp4"] == 9000e12 and plan.throughput["mxfp8"] == 4500e12
    assert {m.chosen for m in plan.layers} <= {"fp32", "bf16", "mxfp8", "nvfp4"}
    assert "nvfp4" in plan.layers[0].sqnr_out
    from mixprec.plan import format_throughput
    thr, notes = format_throughput("measure", ["fp32", "nvfp4"], device=torch.device("cpu"), n=64,
                                   min_time=0.01)
    assert "nvfp4" not in thr and any("nvfp4 left out" in n for n in notes)
