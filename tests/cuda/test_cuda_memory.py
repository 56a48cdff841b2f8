"""``mixprec memory``'s estimate against what the CUDA caching allocator saw at its peak
(``torch.cuda.max_memory_allocated`` over a few training steps, in a fresh process per mode, as
``bench train`` measures it): within 10 %."""
from __future__ import annotations

import pytest

from mixprec.bench.model_spec import model_config
from mixprec.bench.modes import TrainBenchConfig, measure_peak_memory
from mixprec.estimate.memory import ModelShape, estimate_memory

pytestmark = pytest.mark.cuda
MODEL = "gpt2-124m:num_layers=4"           # GPT-2's width and vocabulary, 4 blocks: ~60M parameters
BATCH, SEQ = 8, 512


@pytest.mark.parametrize("mode", ["32-true", "bf16-mixed", "bf16-true"])
def test_the_estimated_peak_is_within_10_percent_of_the_allocators(mode):
    cfg = TrainBenchConfig(model=MODEL, modes=(mode,), batch=BATCH, seq=SEQ, device="cuda")
    measured = measure_peak_memory(mode, cfg, steps=3, timeout=300)
    assert measured is not None
    shape = ModelShape.from_config(model_config(MODEL).replace(max_seq_len=max(SEQ, 1024)))
    est = estimate_memory(shape, mode, batch=BATCH, seq=SEQ, device="cuda")
    assert abs(est.peak - measured) / measured <= 0.10, (
        f"{mode}: estimated {est.peak / 2**20:.0f} MiB, allocator peak {measured / 2**20:.0f} MiB")
