"""``loss_chunk`` as a run setting: from the command line's ``key=value`` to the model, through
``fit()``'s training step, into the memory check, and refused in one line where it cannot act.

Numerics against the unchunked run in ``32-true``: the chunked loss differs only in FP32
summation order, so losses agree to 1e-6 relative and weights after three AdamW steps to 1e-3
of each tensor's largest change (Adam divides by sqrt(v): a near-zero gradient's last-bit
difference moves its update by up to ~3e-4 of that change here); the per-slice loss and gradient
numerics (1e-5) are tests/models/test_models_transformer.py's.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.errors import ConfigError
from mixprec.models.objective import apply_loss_chunk
from mixprec.train.config import FitConfig, TrainConfig, load_config, parse_overrides
from mixprec.train.trainer import Trainer

_QUIET = dict(audit=False, progress=False, trace_nonfinite=False)


def _tiny():
    torch.manual_seed(0)
    return mp.models.Transformer.from_preset("tiny", vocab_size=64, max_seq_len=16, d_model=32)


def _train(loss_chunk: int, steps: int = 3):
    model = _tiny()
    before = [p.detach().clone() for p in model.parameters()]
    cfg = FitConfig(precision="32-true", loss_chunk=loss_chunk, lr=3e-3, warmup_steps=1, **_QUIET)
    trainer = Trainer(model, config=cfg, strategy="single")
    trainer.prepare(total_steps=steps)
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    losses = [float(trainer.train_step([(x, x.roll(-1, 1))]).loss) for _ in range(steps)]
    return model, before, losses


def test_the_command_line_setting_reaches_the_model_and_the_config():
    cfg, source = load_config(overrides=parse_overrides(["loss_chunk=24", "model=tiny"]))
    assert isinstance(cfg, TrainConfig) and cfg.loss_chunk == 24 and source["loss_chunk"] == "command line"
    model = _tiny()
    trainer = Trainer(model, config=cfg.fit_config(), strategy="single")
    trainer.prepare(total_steps=2)
    assert model.loss_chunk == 24
    assert any("24 tokens at a time" in message for message, _ in trainer._notes)   # the start notes
    with pytest.raises(ConfigError, match="loss_chunk must be >= 0"):
        load_config(overrides={"loss_chunk": "-1"})


def test_a_chunked_fit_trains_as_the_unchunked_one_in_fp32():
    plain, before, plain_losses = _train(0)
    chunked, _, chunked_losses = _train(24)          # 64 tokens a step: slices of 24 + 24 + 16
    assert plain.loss_chunk == 0 and chunked.loss_chunk == 24
    assert chunked_losses == pytest.approx(plain_losses, rel=1e-6)
    for p, c, b in zip(plain.parameters(), chunked.parameters(), before):
        change = (p - b).abs().max().clamp_min(1e-12)
        assert ((p - c).abs().max() / change).item() < 1e-3


class _OwnModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, y=None):
        return self.lin(x).sum()


def test_models_it_does_not_apply_to_are_refused_in_one_line():
    with pytest.raises(ConfigError) as own:
        apply_loss_chunk(_OwnModel(), 256)
    assert "_OwnModel returns its whole logits: set loss_chunk=0" in str(own.value)
    assert "\n" not in str(own.value)
    apply_loss_chunk(_OwnModel(), 0)                  # off: nothing to refuse
    with pytest.raises(ConfigError, match="with loss_fn= the loss is computed by your function"):
        apply_loss_chunk(_tiny(), 256, loss_fn=lambda out, y: out.sum())
    model = _tiny()
    model.loss_chunk = 128
    with pytest.raises(ConfigError, match="the model's loss_chunk is 128 but the run's is 0"):
        apply_loss_chunk(model, 0)


def test_a_hugging_face_model_is_refused_before_training():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg)
    trainer = Trainer(model, config=FitConfig(precision="32-true", loss_chunk=256, **_QUIET),
                      strategy="single")
    with pytest.raises(ConfigError, match="a LlamaForCausalLM returns its whole logits: set loss_chunk=0"):
        trainer.prepare(total_steps=2)


def test_the_memory_check_of_mixprec_train_counts_the_chunked_loss():
    from mixprec.cli.train import _step_memory
    with torch.device("meta"):
        model = mp.models.Transformer.from_preset("gpt-ref")
    common = dict(model="gpt-ref", batch_size=8, seq_len=256, precision="32-true")
    _, plain = _step_memory(model, TrainConfig(**common), on_cpu=True)
    _, chunked = _step_memory(model, TrainConfig(**common, loss_chunk=256), on_cpu=True)
    from mixprec.estimate.memory import ModelShape, estimate_memory
    direct = estimate_memory(ModelShape.from_config(model.config), "32-true", batch=8, seq=256,
                             device="cpu", loss_chunk=256)
    assert chunked.loss_buffers == direct.loss_buffers < plain.loss_buffers / 2
    assert chunked.peak == direct.peak < plain.peak
