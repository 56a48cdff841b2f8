"""Measuring a matmul peak (the meter does, at the start of a run and again mid-run when the MFU
passes 100 %) leaves the global random streams alone: a resumed run's dropout masks stay those
of an uninterrupted run (the HF resume test failed when the peak cache could not be written)."""
import random

import torch

from mixprec.policy import peak


def test_measuring_a_matmul_peak_does_not_move_the_global_rng(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXPREC_CACHE", str(tmp_path))
    before = torch.get_rng_state(), random.getstate()
    peak.matmul_flops(torch.float32, "cpu", n=32, min_time=0.0, warmup=1)
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
