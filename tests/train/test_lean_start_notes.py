"""A run's start lines say which lean options took effect: before, ``moments=int8`` and
``fp8_activations=true`` showed only in the settings echo, with no line saying what ran."""
from __future__ import annotations

import torch

import mixprec as mp
from mixprec.train.config import FitConfig
from mixprec.train.trainer import Trainer


def _prepared(**settings) -> Trainer:
    torch.manual_seed(0)
    model = mp.models.Transformer.from_preset("tiny", vocab_size=64, max_seq_len=16, d_model=32)
    trainer = Trainer(model, config=FitConfig(audit=False, progress=False, trace_nonfinite=False,
                                              **settings), strategy="single")
    trainer.prepare(total_steps=2)
    return trainer


def test_int8_moments_and_fp8_activations_are_said_at_the_start():
    trainer = _prepared(precision="bf16-true", moments="int8", fp8_activations=True)
    notes = [message for message, _ in trainer._notes] + trainer.precision.notes
    assert any(n.startswith("Adam moments stored in int8 with per-block scales") for n in notes), notes
    linears = sum(isinstance(m, torch.nn.Linear) for m in trainer.raw_model.modules())
    assert any(n.startswith(f"activations: what {linears} Linear layers save for backward kept in FP8")
               for n in notes), notes


def test_default_moments_and_activations_add_no_line():
    trainer = _prepared(precision="bf16-true")
    notes = [message for message, _ in trainer._notes] + trainer.precision.notes
    assert not any(n.startswith(("Adam moments stored", "activations:")) for n in notes), notes
