"""mixprec.optim.AdamW: parity with torch.optim.AdamW, BF16 moments, stochastic rounding."""
from __future__ import annotations

import pytest
import torch

from mixprec.errors import ConfigError
from mixprec.optim import AdamW
from mixprec.optim.adamw import _AdamWFP32Math, _round_to_bf16_stochastic_


def _regression(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 32, generator=gen)
    y = x @ torch.randn(32, 4, generator=gen) + 0.01 * torch.randn(256, 4, generator=gen)
    return x, y


def _linear(seed: int = 1) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(32, 4)


def _fit(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> float:
    x, y = _regression()
    for _ in range(steps):
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
    return (model(x) - y).pow(2).mean().item()


@pytest.mark.parametrize("impl", [{"foreach": False}, {"foreach": True}, {"fused": True}], ids=str)
def test_fp32_params_and_moments_match_torch_adamw_exactly(impl):
    model, ref = _linear(), _linear()
    groups = lambda m: [{"params": [m.weight], "weight_decay": 0.1}, {"params": [m.bias], "lr": 3e-3}]  # noqa: E731
    opt = AdamW(groups(model), lr=1e-2, betas=(0.8, 0.99), eps=1e-7, **impl)
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.01, **impl)
    _fit(model, opt, 10)
    _fit(ref, ref_opt, 10)
    assert torch.equal(model.weight, ref.weight) and torch.equal(model.bias, ref.bias)


def test_our_foreach_math_matches_torch_adamw_within_1e_6_relative():
    # The BF16-moment code path, run with FP32 moments, is plain AdamW: decoupled decay, bias
    # correction, per-param step counts (the bias skips its grad every third step).
    model, ref = _linear(), _linear()
    kw = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8}
    groups = lambda m: [{"params": [m.weight], "weight_decay": 0.1}, {"params": [m.bias], "weight_decay": 0.0}]  # noqa: E731
    opt = _AdamWFP32Math(groups(model), weight_decay=0.01, moments_dtype=torch.float32,
                         stochastic_rounding=False, seed=None, **kw)
    ref_opt = torch.optim.AdamW(groups(ref), foreach=False, **kw)
    x, y = _regression()
    for step in range(30):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            (m(x) - y).pow(2).mean().backward()
            if step % 3 == 2:
                m.bias.grad = None
            o.step()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
    assert opt.state[model.bias]["step"].item() == ref_opt.state[ref.bias]["step"].item() == 20


@pytest.mark.parametrize("stochastic", [True, False], ids=["stochastic", "nearest"])
def test_bf16_moments_train_as_well_as_fp32_moments_on_a_small_regression(stochastic):
    fp32_model, bf16_model = _linear(), _linear()
    fp32_loss = _fit(fp32_model, AdamW(fp32_model.parameters(), lr=1e-2), 200)
    bf16_opt = AdamW(bf16_model.parameters(), lr=1e-2, moments_dtype=torch.bfloat16,
                     stochastic_rounding=stochastic, seed=0)
    bf16_loss = _fit(bf16_model, bf16_opt, 200)
    assert all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.bfloat16 for s in bf16_opt.state.values())
    x, y = _regression()
    initial = (_linear()(x) - y).pow(2).mean().item()
    assert fp32_loss < 0.05 * initial
    # Stated tolerance: final loss within 10 % of the FP32-moment run, weights within 2e-2.
    assert abs(bf16_loss - fp32_loss) <= 0.1 * fp32_loss
    torch.testing.assert_close(bf16_model.weight, fp32_model.weight, rtol=2e-2, atol=2e-2)


def _second_moment_after_gradients_shrink(moments_dtype: torch.dtype, stochastic: bool) -> torch.Tensor:
    """exp_avg_sq after 20 steps of |g| = 1 followed by 500 steps of |g| = 0.01."""
    p = torch.nn.Parameter(torch.zeros(4096))
    opt = AdamW([p], lr=0.0, weight_decay=0.0, moments_dtype=moments_dtype,
                stochastic_rounding=stochastic, seed=0)
    for step in range(520):
        p.grad = torch.full_like(p, 1.0 if step < 20 else 0.01)
        opt.step()
    return opt.state[p]["exp_avg_sq"].float()


def test_nearest_rounding_freezes_exp_avg_sq_and_stochastic_rounding_lets_it_decay():
    # Why stochastic rounding is the default: v * 0.999 is within half a BF16 ULP of v.
    reference = _second_moment_after_gradients_shrink(torch.float32, False).mean().item()
    stochastic = _second_moment_after_gradients_shrink(torch.bfloat16, True).mean().item()
    nearest = _second_moment_after_gradients_shrink(torch.bfloat16, False).mean().item()
    peak = 1.0 - 0.999**20  # v right after the large gradients
    assert reference < 0.65 * peak  # in FP32 it decays by 0.999**500 ~ 0.61
    assert stochastic == pytest.approx(reference, rel=0.02)
    assert nearest > 0.95 * peak  # stuck: every decay step rounds back


def test_stochastic_rounding_is_unbiased_and_lands_on_bf16_values():
    value = 1.0 + 2.0**-9  # a quarter of the way between two BF16 neighbours (ULP 2**-7)
    x = torch.full((200_000,), value)
    _round_to_bf16_stochastic_(x, torch.Generator().manual_seed(0))
    assert torch.equal(x, x.bfloat16().float())  # exactly representable
    assert set(x.unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert x.mean().item() == pytest.approx(value, abs=2e-5)  # ~4 sigma of the binomial noise
    special = torch.tensor([float("inf"), float("-inf"), 0.0, -3.0])
    _round_to_bf16_stochastic_(special, None)
    assert special.tolist() == [float("inf"), float("-inf"), 0.0, -3.0]


@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16])
def test_fp16_params_converts_the_model_and_keeps_exact_fp32_masters(param_dtype):
    model = _linear()
    weights = model.weight.detach().clone()
    opt = AdamW(model.parameters(), fp16_params=True, param_dtype=param_dtype, moments_dtype=torch.bfloat16)
    assert model.weight.dtype == model.bias.dtype == param_dtype
    assert torch.equal(opt.master_of(model.weight), weights)
    x, y = _regression()
    model(x.to(param_dtype)).float().sub(y).pow(2).mean().backward()
    opt.step()
    assert torch.equal(model.weight.detach(), opt.master_of(model.weight).to(param_dtype))


def test_low_precision_params_get_masters_without_fp16_params():
    model = _linear().half()
    opt = AdamW(model.parameters())
    assert len(opt.masters) == 2 and all(m.dtype == torch.float32 for m in opt.masters)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, "lr"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"eps": -1e-8}, "eps"),
        ({"weight_decay": float("nan")}, "weight_decay"),
        ({"param_dtype": torch.float32}, "param_dtype"),
        ({"moments_dtype": torch.float16}, "moments_dtype"),
        ({"moments_dtype": torch.bfloat16, "fused": True}, "fused"),
    ],
)
def test_invalid_settings_raise_config_error(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        AdamW(_linear().parameters(), **kwargs)
