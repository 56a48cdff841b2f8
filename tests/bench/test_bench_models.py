"""``bench train --model``: GPT-2-shaped presets, fields changed after a colon, torchao's float8 peer."""
from __future__ import annotations

import pytest
import torch

from mixprec.bench import modes
from mixprec.bench.model_spec import model_config
from mixprec.errors import ConfigError


def test_a_preset_with_fields_changed_after_a_colon():
    cfg = model_config("gpt2-355m:num_layers=2,max_seq_len=128,tie_embeddings=false,norm=rmsnorm")
    assert (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.vocab_size) == (2, 1024, 16, 50304)
    assert cfg.max_seq_len == 128 and cfg.tie_embeddings is False and cfg.norm == "rmsnorm"
    assert model_config("gpt2-124m") == model_config("GPT2-124M:")


@pytest.mark.parametrize("spec, says", [("gpt2-355m:num_layer=2", "did you mean"),
                                        ("gpt2-355m:num_layers", "FIELD=VALUE"),
                                        ("gpt2-3555m", "valid:")])
def test_bad_model_specs_are_refused_in_one_line(spec, says):
    with pytest.raises(ConfigError, match=says) as e:
        modes.TrainBenchConfig(model=spec)
    assert "\n" not in str(e.value)


def test_the_changed_fields_reach_the_benchmarked_model_and_its_flops():
    cfg = modes.TrainBenchConfig(model="gpt2-124m:num_layers=1,d_model=64,num_heads=4,vocab_size=256",
                                 batch=2, seq=16)
    model, x, _ = modes._model_and_batch(cfg, torch.device("cpu"))
    assert len(model.blocks) == 1 and model.config.d_model == 64 and x.shape == (2, 16)
    assert modes._flops_per_token(cfg) == model.flops_per_token(seq_len=16)


def test_torchao_float8_is_a_peer_skipped_off_an_fp8_gpu_saying_why():
    assert "torchao-float8" in modes.PEERS
    cfg = modes.TrainBenchConfig(model="tiny", modes=("torchao-float8",), batch=2, seq=16, device="cpu")
    assert modes.build_contender("torchao-float8", cfg) is None
    assert "FP8 tensor cores" in modes.skip_reason("torchao-float8", torch.device("cpu"))
    assert modes.skip_reason("bnb-adamw8bit", torch.device("cpu")) == "its package is not installed"
