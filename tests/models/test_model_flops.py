"""MFU's FLOPs for a model without ``flops_per_token`` (Hugging Face): 6 x all parameters
counted the embedding look-ups, which overstated a tiny model's MFU; now the matmul parameters
(a tied head counts) plus the attention term from the config's layers and width."""
from __future__ import annotations

import pytest
from torch import nn

from mixprec.models.flops import model_flops
from mixprec.models import Transformer


def test_a_tiny_llama_counts_its_matmuls_not_its_embedding_and_adds_attention():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=176,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    total = sum(p.numel() for p in model.parameters())
    f = model_flops(model)
    assert f.matmul_params == total - 4096 * 64          # the untied lm_head counts, embed_tokens not
    assert f.matmul_params < 0.6 * total                  # embeddings were most of this model
    assert (f.layers, f.width) == (2, 64)
    assert f.per_token(128) == 6.0 * f.matmul_params + 6.0 * 2 * 64 * 128
    assert f.per_token(None) == 6.0 * f.matmul_params and "no attention term" in f.describe(None)


def test_a_tied_head_counts_once_and_learned_positions_do_not():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    total = sum(p.numel() for p in model.parameters())   # the tied wte/lm_head weight once
    f = model_flops(model)
    assert f.matmul_params == total - 64 * 32              # wpe left out; wte is the head's matmul
    assert (f.layers, f.width) == (2, 32)


def test_the_rule_matches_the_transformers_own_count():
    model = Transformer.from_preset("tiny")
    f = model_flops(model)
    T = model.config.max_seq_len
    assert f.per_token(T) == pytest.approx(model.flops_per_token(), rel=1e-9)


def test_a_module_without_a_config_has_no_attention_term():
    net = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 100))
    f = model_flops(net)
    assert f.matmul_params == 8 * 100 + 100 and f.layers is None
    assert f.per_token(16) == 6.0 * f.matmul_params
    assert "no layers/width" in f.describe(16)
