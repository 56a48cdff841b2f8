"""``Precision.describe(model)``: every precision decision for a model in one printed table."""
import pytest
import torch
from torch import nn

import mixprec as mp


def test_the_table_of_mixprecs_transformer_in_fp8():
    model = mp.Transformer.from_preset("tiny", num_layers=1)
    precision = mp.Precision("fp8-tensorwise")
    before = precision.resolve(model)
    precision.setup(model)
    after = precision.resolve(model)
    assert [(r.name, r.compute) for r in before] == [(r.name, r.compute) for r in after]  # same decisions
    assert after["blocks.0.attn.qkv"].compute == "fp8-tensorwise"
    head = after["head"]
    assert head.kind == "head" and head.compute == "bf16" and "refused: output head tied" in head.why
    assert after["blocks.0.ln1"].fp32_island and after["blocks.0.ln1"].kind == "norm"
    text = precision.describe(model)
    assert text.splitlines()[0] == "precision fp8-tensorwise: 10 modules with parameters"
    assert "module" in text.splitlines()[1] and "blocks.0.mlp.fc" in text


def test_the_table_of_a_hugging_face_llama_in_bf16_true():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    precision = mp.Precision("bf16-true")
    precision.setup(model)
    table = precision.resolve(model)
    norms = [r for r in table if r.kind == "norm"]
    assert len(norms) == 3 and all(r.fp32_island and r.storage == torch.float32 and not r.master
                                   for r in norms)          # two per layer and the final one
    for r in norms:
        assert dict(model.named_modules())[r.name].weight.dtype == torch.float32   # as the table says
    proj = table["model.layers.0.mlp.gate_proj"]
    assert proj.kind == "linear" and proj.storage == torch.bfloat16 and proj.master
    assert table["lm_head"].kind == "head"
    assert "LlamaRMSNorm" in precision.describe(model)


def test_the_table_of_a_users_own_module_with_overrides():
    class Mine(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 32)
            self.body = nn.Linear(32, 32)
            self.router = nn.Linear(32, 4)
            self.norm = nn.LayerNorm(32)
            self.scale = nn.Parameter(torch.ones(32))

    precision = mp.Precision("bf16-mixed", overrides={"body": "fp32"})
    table = precision.resolve(Mine())
    assert [r.name for r in table] == ["", "embed", "body", "router", "norm"]
    assert table[""].kind == "other" and table["embed"].compute == "-"
    assert table["body"].compute == "fp32" and "per-layer format fp32" in table["body"].why
    assert table["router"].kind == "gate" and table["router"].fp32_island
    assert table["norm"].compute == "fp32" and table.islands == ["body", "router", "norm"]
    assert "(root)" in str(table)


def test_the_audits_layer_formats_are_the_tables_before_and_after_setup():
    from mixprec.monitor.audit import audit
    model = mp.Transformer.from_preset("tiny", num_layers=1)
    precision = mp.Precision("bf16-mixed", overrides={"*": "fp8-tensorwise"})

    def said():
        found = next(f for f in audit(model, precision=precision) if f.code == "layer-formats")
        return dict(kv.split("=") for kv in found.message.split(": ", 1)[1].split(", "))

    before = said()                                     # the head is refused FP8 before set-up too
    assert before == {r.name: r.compute for r in precision.resolve(model) if r.per_layer}
    assert before["head"] == "bf16" and before["blocks.0.mlp.fc"] == "fp8-tensorwise"
    precision.setup(model)
    assert said() == before


def test_an_fp8_override_the_rules_refuse_is_warned_about_before_set_up_too():
    from mixprec.monitor.audit import audit
    model = mp.Transformer.from_preset("tiny", num_layers=1)
    precision = mp.Precision("bf16-mixed", overrides={"head": "fp8-tensorwise"})
    assert precision.resolve(model)["head"].refused == "output head tied to an embedding"

    def warned():
        return [f.message for f in audit(model, precision=precision) if f.code == "fp8-override-refused"]

    before = warned()
    assert before == ["overrides ask FP8 for layers the FP8 rules keep out: head (output head tied to "
                      "an embedding), runs bf16"]
    precision.setup(model)
    assert warned() == before


def test_the_table_before_set_up_shows_the_micro_conversion_that_set_up_does():
    """Under nvfp4 the recipe keeps the last block and the tied head in the surrounding format: the
    table said nvfp4 for them before set-up (and gave no reason after it)."""
    import mixprec as mp
    before_model = mp.models.Transformer.from_preset("tiny")
    before = {r.name: (r.compute, r.why) for r in mp.Precision("nvfp4").resolve(before_model)}
    after_model = mp.models.Transformer.from_preset("tiny")
    precision = mp.Precision("nvfp4")
    precision.setup(after_model)
    after = {r.name: (r.compute, r.why) for r in precision.resolve(after_model)}
    assert {n: c for n, (c, _) in before.items()} == {n: c for n, (c, _) in after.items()}
    assert before["blocks.1.mlp.fc"][0] == "bf16" and before["blocks.0.mlp.fc"][0] == "nvfp4"
    assert "recipe keeps the first 0 / last 1 of 2 blocks" in after["blocks.1.mlp.fc"][1]
    assert "output head" in before["head"][1] and before["head"] == after["head"]
