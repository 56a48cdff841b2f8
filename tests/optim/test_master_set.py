"""``MasterWeights`` is given the set of parameters that need FP32 masters (the per-layer table's
``master`` column); without one it decides by dtype and the decider's record of FP32 islands,
never by attributes on the parameters."""
from __future__ import annotations

import torch
from torch import nn

import mixprec as mp
from mixprec.optim import AdamW, MasterWeights


def _bf16_pair():
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(4, 4).bfloat16())
    b = nn.Parameter(torch.randn(4).bfloat16())
    return a, b


def test_given_set_gets_masters_exactly_even_against_the_dtype():
    a, b = _bf16_pair()
    opt = MasterWeights(torch.optim.SGD, [a, b], master_params=[a], lr=0.1)
    assert opt.master_of(a) is not a and opt.master_of(a).dtype == torch.float32
    assert opt.master_of(b) is b                       # not in the set: its own (BF16) master


def test_given_set_decides_conversion_not_the_param_attribute():
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(3))
    b.keep_in_fp32 = True                              # an attribute optim no longer reads
    opt = MasterWeights(torch.optim.SGD, [a, b], param_dtype=torch.bfloat16, master_params=[a, b], lr=0.1)
    assert a.dtype == b.dtype == torch.bfloat16
    opt2 = MasterWeights(torch.optim.SGD, [c := nn.Parameter(torch.randn(2))], param_dtype=torch.bfloat16,
                         master_params=[], lr=0.1)
    assert c.dtype == torch.float32 and opt2.master_of(c) is c


def test_fallback_asks_the_deciders_record_of_fp32_islands():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    mp.precision.mark_fp32_params(model)               # records the rule book's islands (the norm)
    AdamW(model.parameters(), fp16_params=True, param_dtype=torch.bfloat16)
    assert model[0].weight.dtype == torch.bfloat16
    assert model[1].weight.dtype == torch.float32


def test_setup_hands_the_tables_set_to_the_optimizer():
    model = mp.Transformer.from_preset("tiny", num_layers=1)
    precision = mp.Precision("bf16-true")
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    table = {id(p) for p in precision.layers.master_params(model)}
    rows = {r.name: r for r in precision.resolve(model)}
    assert rows["blocks.0.attn.qkv"].master and not rows["blocks.0.ln1"].master
    for p in model.parameters():
        assert (opt.master_of(p) is not p) == (id(p) in table)
    assert id(model.blocks[0].ln1.weight) not in table
