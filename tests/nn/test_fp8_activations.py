"""FP8-stored activations (mixprec.nn.fp8_activations): Linear inputs saved for backward in E4M3.

Numerics against the unhooked model: the forward is bit-identical (the FP8 copy is only for
backward); gradients within 5 % relative L2 per parameter (E4M3 keeps 3 mantissa bits). Bytes:
the stored copies take 1 + 4/128 bytes per value.
"""
from __future__ import annotations

import pytest
import torch

import mixprec as mp
from mixprec.errors import ConfigError
from mixprec.nn.fp8_activations import BYTES_PER_VALUE, store_activations_in_fp8


def _model(mode: str, checkpointing: bool = False):
    torch.manual_seed(0)
    model = mp.models.Transformer(num_layers=2, d_model=64, num_heads=4, max_seq_len=32,
                                  gradient_checkpointing=checkpointing)
    precision = mp.Precision(mode)
    return precision.setup_module(model), precision


def _grads(model, precision, x):
    with precision.autocast():
        logits, loss = model(x, x)
    loss.backward()
    grads = [p.grad.detach().float().clone() for p in model.parameters()]
    model.zero_grad()
    return logits.detach(), grads


@pytest.mark.parametrize("mode", ["32-true", "bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_forward_is_unchanged_and_gradients_stay_close(mode, checkpointing):
    model, precision = _model(mode, checkpointing)
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    ref_logits, ref = _grads(model, precision, x)
    store = store_activations_in_fp8(model)
    logits, got = _grads(model, precision, x)
    assert torch.equal(logits, ref_logits)
    for a, b in zip(ref, got):
        assert ((a - b).norm() / (a.norm() + 1e-12)).item() < 0.05
    linears = 9                                       # 2 blocks x 4 Linears + the head
    # Checkpointed blocks belong to torch's checkpoint: only the head stores FP8 there.
    assert store.packed == (1 if checkpointing else linears)
    assert store.packed_bytes / store.original_bytes == pytest.approx(
        BYTES_PER_VALUE / (4 if mode == "32-true" else 2), rel=1e-6)
    store.remove()
    _, again = _grads(model, precision, x)
    assert all(torch.equal(a, b) for a, b in zip(ref, again))   # removed: exact again


def test_weights_and_their_autocast_copies_are_not_packed():
    lin = torch.nn.Linear(64, 64)
    store = store_activations_in_fp8(lin, min_numel=1)
    x = torch.randn(32, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lin(x).float().sum().backward()
    assert store.packed == 1 and store.original_bytes == 32 * 64 * 2     # the bf16 input only


def test_trainer_option_trains_and_refuses_replanning():
    from mixprec.train.config import FitConfig
    from mixprec.train.trainer import Trainer
    torch.manual_seed(0)
    model = mp.models.Transformer.from_preset("tiny", vocab_size=64, max_seq_len=16, d_model=32)
    cfg = FitConfig(precision="32-true", fp8_activations=True, lr=3e-3, warmup_steps=1, audit=False,
                    progress=False, trace_nonfinite=False)
    trainer = Trainer(model, config=cfg, strategy="single")
    trainer.prepare(total_steps=20)
    assert trainer.fp8_store is not None
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 64, (8, 16), generator=g)
    losses = [trainer.train_step([(x, x)]).loss for _ in range(20)]
    assert trainer.fp8_store.packed > 0 and losses[-1] < losses[0]
    bad = FitConfig(precision="32-true", fp8_activations=True, replan_every=5, audit=False, progress=False)
    with pytest.raises(ConfigError, match="fp8_activations"):
        Trainer(mp.models.Transformer.from_preset("tiny"), config=bad, strategy="single").prepare(total_steps=2)
