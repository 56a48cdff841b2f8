"""FP16 training of a tiny Transformer where a LayerNorm computed in FP16 breaks and ours does not.

Construction: the learned position embeddings are scaled to magnitude ~1e3-4e3 (plus a constant
offset of 1e3), so the residual stream holds values FP16 can represent but whose squares it cannot
(> 65504). Training runs under ``mixprec.autocast("16-mixed")`` with mixprec's GradScaler.

* ours (FP32 statistics): no inf/NaN anywhere, no skipped step, the loss goes down;
* a two-pass LayerNorm computed in FP16: the variance is inf, every normalised row collapses to the
  bias, and the model cannot learn (loss stays at ln(256));
* a one-pass LayerNorm computed in FP16 (``E[x^2] - E[x]^2``): inf - inf = NaN, every step is
  skipped by the scaler and the loss scale halves each step.
"""
import math

import torch
from torch import nn

from mixprec import autocast
from mixprec.amp import GradScaler
from mixprec.models import Transformer
from mixprec.nn import MixedPrecisionLayerNorm

STEPS = 5


class NaiveFp16LayerNorm(nn.Module):
    """A LayerNorm that computes in FP16 (what casting the whole model to half gives you)."""

    def __init__(self, ln: MixedPrecisionLayerNorm, one_pass: bool) -> None:
        super().__init__()
        self.weight, self.bias, self.eps, self.one_pass = ln.weight, ln.bias, ln.eps, one_pass
        self.saw_inf_variance = False

    def forward(self, x):
        h = x.half()
        mu = h.mean(-1, keepdim=True)
        if self.one_pass:
            var = (h * h).mean(-1, keepdim=True) - mu * mu
        else:
            var = ((h - mu) * (h - mu)).mean(-1, keepdim=True)
        self.saw_inf_variance |= bool(torch.isinf(var).any() | torch.isinf(h * h).any())
        return ((h - mu) / torch.sqrt(var + self.eps) * self.weight.half() + self.bias.half()).to(x.dtype)


def build(naive: str | None) -> Transformer:
    torch.manual_seed(0)
    model = Transformer.from_preset("tiny", max_seq_len=32)
    with torch.no_grad():
        model.wpe.weight.mul_(5e4).add_(1e3)  # |x| ~ 1e3..4e3: finite in FP16, squares are not
    if naive:
        for parent in list(model.modules()):
            for child_name, child in list(parent.named_children()):
                if isinstance(child, MixedPrecisionLayerNorm):
                    setattr(parent, child_name, NaiveFp16LayerNorm(child, one_pass=naive == "one-pass"))
    return model


def train(model: Transformer) -> tuple[list[float], GradScaler]:
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (4, 17), generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = GradScaler(device="cpu")
    losses = []
    for _ in range(STEPS):
        with autocast("16-mixed", device_type="cpu"):
            _, loss = model(data[:, :-1], data[:, 1:])
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return losses, scaler


def test_residual_stream_is_fp16_representable_but_its_squares_are_not():
    model = build(None)
    x = model.wpe.weight
    assert x.abs().max() < 65504 and (x.abs() > 256).any()


def test_fp32_statistics_layernorm_trains_in_fp16():
    losses, scaler = train(build(None))
    assert all(math.isfinite(v) for v in losses)
    assert scaler.num_skipped_steps == 0
    assert losses[-1] < losses[0] - 0.05  # it learns: ~5.56 -> ~5.39 in 5 steps


def test_two_pass_fp16_layernorm_overflows_and_cannot_learn():
    model = build("two-pass")
    losses, scaler = train(model)
    assert any(m.saw_inf_variance for m in model.modules() if isinstance(m, NaiveFp16LayerNorm))
    assert abs(losses[-1] - losses[0]) < 0.01  # stuck near ln(256) = 5.545: rows collapsed to the bias
    assert abs(losses[0] - math.log(256)) < 0.05


def test_one_pass_fp16_layernorm_gives_nan_and_every_step_is_skipped():
    losses, scaler = train(build("one-pass"))
    assert all(math.isnan(v) for v in losses)
    assert scaler.num_skipped_steps == STEPS
    assert scaler.get_scale() == 2.0 ** 16 / 2 ** STEPS
