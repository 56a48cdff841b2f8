"""An inf/NaN in any FP8 GEMM operand reaches the step's own non-finite check (issue #36, item 2).

No cast checks its operand on the host: a non-finite value makes its block's amax and scale
non-finite, which makes the outputs (forward) or the gradients (backward) computed from that
block NaN. So the gradient check ``Precision.step`` runs anyway (fused with the unscale) sees it and
the update is skipped, bit for bit; the layer's device flag (``found_nonfinite``) agrees, and the
next clean step is taken (delayed scaling included: its amax history does not keep the inf)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.formats import found_nonfinite, reset_nonfinite

RECIPES = ["tensorwise", "rowwise", "blockwise", "delayed"]
WHERE = ["input", "weight", "output-gradient"]


def _setup(recipe: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128))
    precision = mp.Precision(f"fp8-{recipe}")
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert type(model[0]).__name__ == type(model[2]).__name__ == "Fp8Linear"
    return precision, model, opt


def _step(precision, model, opt, x):
    opt.zero_grad()
    with precision.autocast():
        out = model(x)
    precision.backward(out.float().pow(2).mean())
    return precision.step(opt)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("recipe", RECIPES)
def test_a_nonfinite_fp8_operand_skips_the_step_and_the_next_clean_one_is_taken(recipe, where):
    precision, model, opt = _setup(recipe)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(1))
    assert _step(precision, model, opt, x)                     # one clean step: state exists
    reset_nonfinite(model)
    before = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]
    hook = None
    bad = x.clone()
    if where == "input":
        bad[2, 5] = float("inf")
    elif where == "weight":
        saved = model[2].weight.detach()[3, 7].clone()
        with torch.no_grad():
            model[2].weight[3, 7] = float("nan")
    else:   # the gradient arriving at the second layer's output
        hook = model[2].register_full_backward_pre_hook(
            lambda m, g: (g[0].index_fill(0, torch.tensor([1]), float("inf")),))
    taken = _step(precision, model, opt, bad)
    if hook is not None:
        hook.remove()
    assert not taken and precision.scaler.last_step_skipped
    assert bool(found_nonfinite(model))                        # the layers' device flag agrees
    if where == "weight":
        with torch.no_grad():
            model[2].weight[3, 7] = saved
    after = list(model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, after))      # the update was skipped
    assert all(torch.equal(v, old[k]) for s, old in zip(opt.state.values(), state)
               for k, v in s.items())                                # moments and step counts
    reset_nonfinite(model)
    assert all(_step(precision, model, opt, x) for _ in range(2))    # clean steps go on
    assert not bool(found_nonfinite(model))
