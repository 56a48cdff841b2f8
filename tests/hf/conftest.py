"""Tiny Hugging Face models and data for tests/hf (each test a few seconds on 2 CPU cores)."""
import json
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 256


def gpt2_config(dropout: float = 0.0, **kw):
    base = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=None,
                eos_token_id=None)
    return transformers.GPT2Config(**{**base, **kw})


def llama_config(**kw):
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return transformers.LlamaConfig(**{**base, **kw})


def build(arch: str, seed: int = 0, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    if arch == "gpt2":
        return transformers.GPT2LMHeadModel(gpt2_config(**kw))
    return transformers.LlamaForCausalLM(llama_config(**kw))


@pytest.fixture
def hf_model():
    """``hf_model("gpt2" | "llama", seed=0, **config)``: a tiny causal LM in FP32."""
    return build


def token_batches(n: int, batch: int = 4, seq: int = 16, seed: int = 1):
    """``n`` (inputs, next-token targets) pairs cut from random token streams."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        s = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
        out.append((s[:, :-1], s[:, 1:]))
    return out


@pytest.fixture
def batches():
    return token_batches


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory):
    """A small deterministic text file (byte-level tokens, vocabulary 256)."""
    words = ("the loss scale grows and backs off while the optimizer steps fp32 master weights; "
             "def forward(self, x): return self.norm(x) + attention in bfloat16").split()
    rng = random.Random(0)
    text = "\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(2500))
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(text + "\n")
    return path


def write_config(folder, config) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config.to_diff_dict()))
    return str(folder / "config.json")


@pytest.fixture
def config_file(tmp_path):
    """``config_file("gpt2" | "llama", **config)``: path of a tiny model's config.json."""
    def make(arch: str, **kw) -> str:
        cfg = gpt2_config(**kw) if arch == "gpt2" else llama_config(**kw)
        return write_config(tmp_path / f"{arch}-config", cfg)
    return make
