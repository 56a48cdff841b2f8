"""MoE layer: vectorised dispatch vs a dense reference of the same routing; router FP32 always.

Tolerances: FP32 experts match the dense reference within 1e-5 (only summation order differs);
FP16/BF16 experts match a dense reference that runs the same experts in the same dtype within
1e-3 / 1e-2 absolute (outputs are O(0.1); rounding of the combine order in FP32 only).
"""
import pytest
import torch
import torch.nn.functional as F

from mixprec.errors import ConfigError
from mixprec.nn import MoELayer
from mixprec.precision import PRESETS, autocast

D, E = 32, 4


def dense_reference(moe: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token; combine with a dense (N, E) weight matrix that is zero
    outside each token's top-k and holds the normalised top-k weights inside."""
    flat = x.reshape(-1, D).float()
    probs = torch.softmax(flat @ moe.gate.weight.float().t(), dim=-1)  # (N, E)
    top_p, top_i = probs.topk(moe.top_k, dim=-1)
    dense_w = torch.zeros_like(probs).scatter(1, top_i, top_p / top_p.sum(-1, keepdim=True))
    outs = []
    for ex in moe.experts:
        w_dtype = ex.fc.weight.dtype
        h = F.gelu(F.linear(flat.to(w_dtype), ex.fc.weight, ex.fc.bias))
        outs.append(F.linear(h, ex.proj.weight, ex.proj.bias).float())
    stacked = torch.stack(outs, dim=1)  # (N, E, D)
    return (dense_w[:, :, None] * stacked).sum(1).reshape(x.shape)


def make(expert_dtype, top_k=2, seed=0):
    torch.manual_seed(seed)
    moe = MoELayer(D, num_experts=E, top_k=top_k, expert_dtype=expert_dtype)
    with torch.no_grad():  # a router with some spread, so top-k is decisive
        moe.gate.weight.normal_(std=0.5)
        for ex in moe.experts:
            ex.fc.bias.normal_(std=0.1)
    return moe


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_fp32_experts_match_dense_reference(top_k):
    moe = make(torch.float32, top_k)
    x = torch.randn(3, 40, D)
    out = moe(x)
    assert out.shape == x.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, dense_reference(moe, x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype,atol", [(torch.float16, 1e-3), (torch.bfloat16, 1e-2)])
def test_low_precision_experts_match_dense_reference(dtype, atol):
    moe = make(dtype)
    x = torch.randn(2, 24, D)
    out = moe(x)
    assert moe.experts[0].fc.weight.dtype == dtype and moe.gate.weight.dtype == torch.float32
    torch.testing.assert_close(out, dense_reference(moe, x), rtol=0, atol=atol)


def test_each_expert_runs_once_per_forward_on_all_its_tokens():
    moe = make(torch.float32)
    calls = []
    for e, ex in enumerate(moe.experts):
        ex.register_forward_hook(lambda m, a, o, e=e: calls.append((e, a[0].shape[0])))
    x = torch.randn(4, 64, D)  # 256 tokens, 512 assignments
    moe(x)
    assert len(calls) == len({e for e, _ in calls}) <= E  # no loop over tokens
    assert sum(n for _, n in calls) == 256 * 2
    assert moe.last_counts.sum().item() == 512


def test_aux_loss_formula_and_uniform_value():
    moe = make(torch.float32)
    x = torch.randn(2, 30, D)
    moe(x)
    probs, top_i, _ = moe.route(x.reshape(-1, D))
    f = torch.bincount(top_i.reshape(-1), minlength=E).float() / top_i.numel()
    expected = moe.aux_loss_coef * E * (f * probs.mean(0)).sum()
    torch.testing.assert_close(moe.aux_loss, expected)
    with torch.no_grad():
        moe.gate.weight.zero_()  # uniform router: aux == coef exactly
    moe(x)
    torch.testing.assert_close(moe.aux_loss, torch.tensor(moe.aux_loss_coef))


def test_router_gets_gradient_from_output_and_aux_loss():
    moe = make(torch.float32)
    x = torch.randn(2, 10, D)
    (moe(x).square().sum() + moe.aux_loss).backward()
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0
    assert moe.gate.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("expert_dtype", [torch.float16, torch.bfloat16, None])
def test_gate_fp32_and_experts_in_expert_dtype_under_every_policy(preset, expert_dtype):
    moe = make(expert_dtype)
    seen: dict[str, set] = {"gate": set(), "expert": set()}

    def record(key):
        def hook(module, args, output):  # returns None: observes without replacing the output
            seen[key].add(output.dtype)
        return hook

    moe.gate.register_forward_hook(record("gate"))
    for ex in moe.experts:
        ex.fc.register_forward_hook(record("expert"))
    policy = PRESETS[preset]
    x = torch.randn(1, 16, D)
    # autocast's device is the tensors' (its default, CUDA whenever there is one, would leave
    # these CPU tensors in FP32 on a GPU machine: the experts would then see FP32, not the policy's)
    with autocast(policy, device_type=x.device.type):
        out = moe(x)
    assert seen["gate"] == {torch.float32}
    want = expert_dtype if expert_dtype is not None else policy.compute_dtype
    assert seen["expert"] == {want}
    assert out.dtype == x.dtype and torch.isfinite(out).all()


def test_bad_routing_settings_are_config_errors():
    with pytest.raises(ConfigError, match="top_k"):
        MoELayer(D, num_experts=2, top_k=3)
    with pytest.raises(ConfigError, match="gate_dtype"):
        MoELayer(D, gate_dtype=torch.bfloat16)
