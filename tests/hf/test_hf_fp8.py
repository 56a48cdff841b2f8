"""FP8 on Hugging Face models: GPT-2's Conv1D (a Linear with an (in, out) weight) runs its GEMMs in
FP8 as Fp8Conv1D, keeping its Parameters, layout and state-dict keys; heads and embeddings stay
in high precision and the report says so."""
import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.formats import Fp8Config, Fp8Conv1D, Fp8Linear, is_conv1d, sqnr_db
from mixprec.precision import convert_to_fp8
from mixprec.policy import hardware

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402


def test_conv1d_is_recognised_by_duck_type_only():
    assert is_conv1d(Conv1D(48, 32))                       # nf=48, nx=32: weight (32, 48)

    class Conv1D_(nn.Module):                              # noqa: N801 - another name
        nf = 16
        weight = nn.Parameter(torch.zeros(8, 16))
    NotConv = type("Conv1D", (nn.Module,), {})             # the name, but no nf / weight
    assert not is_conv1d(Conv1D_()) and not is_conv1d(NotConv())
    assert not is_conv1d(nn.Conv1d(4, 4, 3)) and not is_conv1d(nn.Linear(4, 4))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_fp8_conv1d_equals_fp8_linear_on_the_transposed_weight_bit_for_bit(recipe):
    torch.manual_seed(0)
    conv = Conv1D(48, 32)
    nn.init.normal_(conv.bias)
    linear = nn.Linear(32, 48)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    config = Fp8Config.from_recipe(recipe)
    f_conv, f_lin = Fp8Conv1D.from_conv1d(conv, config), Fp8Linear.from_linear(linear, config)
    assert f_conv.weight is conv.weight and f_conv.bias is conv.bias   # the same Parameters
    x = torch.randn(2, 5, 32)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = f_conv(xa), f_lin(xb)
    assert torch.equal(ya, yb)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(xa.grad, xb.grad)
    assert conv.weight.grad.shape == (32, 48) and torch.equal(conv.weight.grad, linear.weight.grad.t())
    assert torch.equal(conv.bias.grad, linear.bias.grad)


def test_gpt2_conversion_counts_layers_keeps_head_and_embeddings_and_says_so(hf_model):
    model = hf_model("gpt2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)          # built before the swap
    params = [p for g in optimizer.param_groups for p in g["params"]]
    keys = {k: v.shape for k, v in model.state_dict().items()}
    precision = mp.Precision("fp8-tensorwise")
    model, optimizer = precision.setup(model, optimizer)
    report = precision.layers.fp8_report
    # 2 blocks x (c_attn, attn.c_proj, c_fc, mlp.c_proj)
    assert report.num_converted == 8
    assert all(isinstance(model.get_submodule(n), Fp8Conv1D) for n in report.converted)
    reasons = dict(report.skipped)
    assert "tied to an embedding" in reasons["lm_head"]
    assert "embedding" in reasons["transformer.wte"] and "embedding" in reasons["transformer.wpe"]
    assert "8 Linear layers converted" in str(report) and "(bf16 compute)" in str(report)
    # the optimizer still holds the model's Parameters; keys and shapes are HF's
    assert {id(p) for p in model.parameters()} == {id(p) for p in params}
    assert {k: v.shape for k, v in model.state_dict().items()} == keys
    fresh = hf_model("gpt2", seed=1)
    fresh.load_state_dict(model.state_dict())                           # loads into plain GPT-2


def test_fp8_gpt2_logits_stay_close_to_the_bf16_model(hf_model, batches):
    """SQNR of the FP8 (tensorwise, emulated) logits against the same model in bf16-mixed: above
    20 dB (about 30 dB measured)."""
    (x, _), = batches(1, batch=4, seq=32)
    reference, fp8 = hf_model("gpt2").eval(), hf_model("gpt2").eval()
    bf16, p8 = mp.Precision("bf16-mixed"), mp.Precision("fp8-tensorwise")
    bf16.setup(reference)
    p8.setup(fp8)
    with torch.no_grad():
        with bf16.autocast():
            a = reference(input_ids=x).logits.float()
        with p8.autocast():
            b = fp8(input_ids=x).logits.float()
    assert sqnr_db(a, b) > 20.0


def test_fp8_tensorwise_trains_gpt2_for_5_steps_and_saves_loadable_weights(hf_model, batches, tmp_path):
    model = hf_model("gpt2")
    before = model.transformer.h[0].attn.c_attn.weight.detach().clone()
    result = mp.fit(model, batches(5), mixed_precision="fp8-tensorwise", max_steps=5, lr=3e-3,
                    warmup_steps=0, progress=False, audit=False, ckpt_interval=0,
                    run_dir=str(tmp_path / "run"))
    assert result.steps == 5 and result.skipped_steps == 0
    layer = model.transformer.h[0].attn.c_attn
    # FP8 tensor cores where fit() trained on a GPU that has them (64 -> 192 is 16-aligned), else
    # the emulation; never silently the other one.
    on_fp8_gpu = layer.weight.device.type == "cuda" and hardware.cuda_supports_fp8()
    assert isinstance(layer, Fp8Conv1D)
    assert layer.execution_path == ("cuda-scaled-mm" if on_fp8_gpu else "emulated")
    weight = layer.weight.detach().cpu()
    assert not torch.equal(weight, before)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf")
    assert type(loaded.transformer.h[0].attn.c_attn) is Conv1D
    assert torch.equal(loaded.transformer.h[0].attn.c_attn.weight, weight)


def test_convert_to_fp8_is_idempotent_on_converted_conv1d(hf_model):
    model = hf_model("gpt2")
    first = convert_to_fp8(model, config=Fp8Config.from_recipe("tensorwise"))
    second = convert_to_fp8(model, config=Fp8Config.from_recipe("tensorwise"))
    assert first.num_converted == 8 and second.num_converted == 0
