"""The numerics monitor checks each layer against the format it runs in, read from the
per-layer table (a per-layer override included), not the mode's one format."""
from __future__ import annotations

import torch

import mixprec as mp
from mixprec.monitor import NumericsMonitor
from mixprec.policy.dtypes import FP8_E4M3, FP8_E5M2


def _run_sample(precision: mp.Precision):
    torch.manual_seed(0)
    model = mp.Transformer.from_preset("tiny", num_layers=1)
    model, _ = precision.setup(model)
    monitor = NumericsMonitor(model, every=1, compute_dtype=precision)
    x = torch.randint(0, 64, (2, 8))
    with monitor.sample(0) as s:
        with precision.autocast():
            out = model(x)
            loss = (out[0] if isinstance(out, tuple) else out).float().mean()
        loss.backward()
    return monitor, {(r.module, r.kind): r.dtype for r in s.rows}


def test_per_layer_fp32_override_is_checked_against_fp32():
    monitor, rows = _run_sample(mp.Precision("bf16-mixed", overrides="blocks.0.attn.qkv=fp32"))
    assert monitor.formats["blocks.0.attn.qkv"] == (torch.float32, torch.float32)
    assert rows[("blocks.0.attn.qkv", "act")] == "fp32"
    assert rows[("blocks.0.attn.proj", "act")] == "bf16"


def test_fp8_mode_checks_fp8_layers_in_e4m3_e5m2_and_the_refused_head_in_its_format():
    monitor, _ = _run_sample(mp.Precision("fp8-tensorwise"))
    assert monitor.formats["blocks.0.attn.qkv"] == (FP8_E4M3, FP8_E5M2)
    row = {r.name: r for r in mp.Precision("fp8-tensorwise").resolve(mp.Transformer.from_preset("tiny", num_layers=1))}["head"]
    assert not row.compute.startswith("fp8-")
    assert monitor.formats["head"][0] != FP8_E4M3
