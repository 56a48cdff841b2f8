"""``bench train`` variants: ``MODE+overlap`` / ``MODE+compile`` and the flags that add them."""
from __future__ import annotations

import argparse

import pytest

from mixprec.bench import modes
from mixprec.cli import bench_train as bench_train_cmd
from mixprec.errors import ConfigError


def test_a_mode_name_carries_its_variants():
    assert modes.split_variant("bf16-mixed") == ("bf16-mixed", frozenset())
    assert modes.split_variant("bf16-mixed+overlap+compile") == ("bf16-mixed",
                                                                  frozenset({"overlap", "compile"}))
    modes.TrainBenchConfig(modes=("32-true+overlap",))          # validated like the mode itself
    with pytest.raises(ConfigError, match=r"did you mean 'overlap'"):
        modes.split_variant("32-true+overlapp")
    with pytest.raises(ConfigError, match="bf61"):
        modes.TrainBenchConfig(modes=("bf61+overlap",))


def test_the_overlap_and_compile_flags_add_a_variant_after_each_mode(monkeypatch, tmp_path):
    seen = {}

    def fake_bench(cfg, memory, log):
        seen["modes"] = cfg.modes
        raise SystemExit(0)
    monkeypatch.setattr(bench_train_cmd, "bench_train", fake_bench)
    p = argparse.ArgumentParser()
    bench_train_cmd.configure(p)
    args = p.parse_args(["--modes", "32-true,bf16-mixed", "--overlap", "--compile", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        bench_train_cmd.run(args)
    assert seen["modes"] == ("32-true", "32-true+compile", "32-true+overlap", "32-true+overlap+compile",
                             "bf16-mixed", "bf16-mixed+compile", "bf16-mixed+overlap",
                             "bf16-mixed+overlap+compile")
    assert p.parse_args(["--profile"]).profile == 3 and p.parse_args([]).profile == 0



def test_the_ckpt_variant_recomputes_every_block_in_backward(monkeypatch):
    """``MODE+ckpt``: the lean table's activation-checkpointing row (docs/performance.md)."""
    import mixprec.models.transformer as tr
    from mixprec.models.config import get_model_config
    calls = []
    real = tr.checkpoint
    monkeypatch.setattr(tr, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = modes.TrainBenchConfig(model="tiny", modes=("32-true", "32-true+ckpt"), batch=1, seq=8)
    modes.build_contender("32-true", cfg).step()
    assert not calls
    modes.build_contender("32-true+ckpt", cfg).step()
    assert len(calls) == get_model_config("tiny").num_layers
