"""One definition of "stays FP32": torch's norms, third-party norms recognised by shape and
behaviour (Hugging Face's LlamaRMSNorm, T5LayerNorm, MistralRMSNorm, a user's own RMSNorm),
``keep_in_fp32`` and ``keep_fp32_names`` — used alike by casting, masters, the audit and FP8."""
import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.formats import Fp8Config
from mixprec.precision import convert_to_fp8
from mixprec.monitor import audit
from mixprec.precision import is_norm

transformers = pytest.importorskip("transformers")


class UserRMSNorm(nn.Module):
    """A user's own RMSNorm under a name that does not end in 'Norm'."""

    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.scale_weight = None
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


UserRMSNorm.__name__ = "UserRMS"


def tiny_llama():
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                                   max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def tiny_gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4,
                                                                vocab_size=256, n_positions=64))


def test_third_party_norms_are_recognised_by_shape_and_behaviour():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm
    for norm in (LlamaRMSNorm(16), MistralRMSNorm(16), T5LayerNorm(16), UserRMSNorm(16), nn.LayerNorm(16)):
        assert is_norm(norm), type(norm).__name__
    for other in (nn.Linear(16, 16), nn.Embedding(10, 16), nn.Conv1d(4, 4, 3)):
        assert not is_norm(other), type(other).__name__


@pytest.mark.parametrize("mode", ["bf16-true", "16-true"])
def test_llama_norms_stay_fp32_under_true_modes_and_the_audit_is_quiet(mode):
    model = tiny_llama()
    precision = mp.Precision(mode)
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    norms = {n: m for n, m in model.named_modules() if type(m).__name__ == "LlamaRMSNorm"}
    assert len(norms) == 5
    assert all(m.weight.dtype == torch.float32 for m in norms.values())
    assert model.model.layers[0].mlp.up_proj.weight.dtype == precision.recipe.param_dtype
    codes = {f.code for f in audit(model, precision=precision, optimizer=opt, device="cpu")}
    assert "half-precision-norm" not in codes and "no-master-weights" not in codes


def test_gpt2_layernorm_stays_fp32_with_fp16_params_and_no_mark_fp32_params(tmp_path):
    torch.manual_seed(0)
    model = tiny_gpt2()
    ln_before = model.transformer.h[0].ln_1.weight.detach().clone()
    opt = mp.optim.AdamW(model.parameters(), lr=1e-3, fp16_params=True)   # the seed's style
    precision = mp.Precision(True, optimizer=opt)    # auto follows the optimizer, when built
    precision.setup(model, opt)
    assert precision.name == "16-true"
    ln = model.transformer.h[0].ln_1.weight
    assert ln.dtype == torch.float32 and torch.equal(ln, ln_before)     # the exact FP32 value back
    assert model.transformer.h[0].mlp.c_fc.weight.dtype == torch.float16


def test_user_rmsnorm_keep_in_fp32_and_name_patterns():
    model = nn.Sequential(nn.Linear(16, 16), UserRMSNorm(16), nn.Linear(16, 16))
    model[2].keep_in_fp32 = True
    policy = mp.get_policy("bf16-true").replace(keep_fp32_names=("0",))
    mp.Precision(policy).setup(model)
    assert [m.weight.dtype for m in model] == [torch.float32] * 3
    plain = nn.Sequential(nn.Linear(16, 16), UserRMSNorm(16))
    mp.Precision("bf16-true").setup(plain)
    assert [m.weight.dtype for m in plain] == [torch.bfloat16, torch.float32]


def test_fp8_conversion_skips_the_same_norms():
    model = nn.Sequential(nn.Linear(32, 32), UserRMSNorm(32), nn.Linear(32, 32))
    report = convert_to_fp8(model, config=Fp8Config.from_recipe("tensorwise"))
    assert ("1", "normalization layer (kept in high precision)") in report.skipped
