"""``profile=STEPS``: a table of where a step's time goes (mixprec's own casts and syncs named),
a Chrome trace in the run folder, and a link to it from ``mixprec report``."""
from __future__ import annotations

import json

import torch

from mixprec.models import Transformer
from mixprec.monitor.profile import categorize
from mixprec.report import report
from mixprec.train.trainer import fit


def test_operators_are_grouped_by_the_kind_of_work():
    assert categorize("aten::mm") == "gemm"
    assert categorize("aten::addmm", ["mixprec.forward"]) == "gemm"
    assert categorize("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert categorize("aten::_to_copy", ["mixprec.forward"]) == "casts"
    assert categorize("aten::copy_", ["aten::_to_copy", "aten::to"]) == "casts"
    assert categorize("aten::topk") == "elementwise"               # not a cast
    assert categorize("aten::_foreach_copy_", ["mixprec.master_copy_back"]) == "casts"
    assert categorize("aten::_foreach_lerp_", ["Optimizer.step#AdamW.step"]) == "optimizer"
    assert categorize("aten::_local_scalar_dense", ["aten::item"]) == "host syncs"
    assert categorize("c10d::allreduce_") == "communication"
    assert categorize("aten::gelu") == "elementwise"


def test_fit_profile_writes_the_table_and_trace_and_report_links_them(tmp_path):
    torch.manual_seed(0)
    model = Transformer.from_preset("tiny", vocab_size=64, max_seq_len=16, d_model=32)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g))
            for _ in range(5)]
    run = tmp_path / "run"
    result = fit(model, data, mixed_precision="bf16-true", max_steps=5, profile=2, run_dir=str(run),
                 log_interval=1, audit=False, progress=False, eval_interval=0, ckpt_interval=0)
    assert result.steps == 5
    table = (run / "profile.txt").read_text()
    assert "profiled 2 step(s)" in table
    for name in ("gemm", "optimizer", "casts", "mixprec.found_inf_sync", "mixprec.unscale",
                 "mixprec.master_copy_back", "mixprec.master_grad_copy"):
        assert name in table, name
    trace = json.loads((run / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "mixprec.found_inf_sync" in names
    page = report.write_report(run).read_text()
    assert 'href="../trace.json"' in page and "mixprec.master_copy_back" in page


def test_a_model_torch_compile_cannot_compile_trains_eager_and_says_why(tmp_path, monkeypatch):
    """compile=true: a compile error in the first step (here raised as torch.compile raises it;
    a real compile takes minutes on the CI machine) undoes the compile and the run goes on eager."""
    import torch._dynamo.exc as dynamo_exc

    from mixprec.runs.metrics import read_events
    from mixprec.train.trainer import Trainer
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self: compiled.append(self))
    real_step = Trainer.train_step
    calls = {"n": 0}

    def failing_first(self, batches):
        calls["n"] += 1
        if calls["n"] == 1:
            raise dynamo_exc.TorchRuntimeError("FP8 emulation: unsupported op")
        return real_step(self, batches)
    monkeypatch.setattr(Trainer, "train_step", failing_first)
    torch.manual_seed(0)
    model = Transformer.from_preset("tiny", vocab_size=64, max_seq_len=16, d_model=32)
    data = [(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))) for _ in range(3)]
    run = tmp_path / "run"
    result = fit(model, data, mixed_precision="32-true", max_steps=3, compile=True, run_dir=str(run),
                 audit=False, progress=False, eval_interval=0, ckpt_interval=0)
    assert result.steps == 3 and compiled == [model]
    notes = [e for e in read_events(run) if e.get("kind") == "compile"]
    assert len(notes) == 1 and "FP8 emulation: unsupported op" in notes[0]["message"]
    assert "training eager" in notes[0]["message"]


def test_overlap_profile_and_compile_are_settings_of_the_command_line():
    from mixprec.errors import ConfigError
    from mixprec.train.config import load_config
    cfg, _ = load_config(None, {"overlap_optimizer": "true", "profile": "3", "compile": "on"})
    assert cfg.overlap_optimizer is True and cfg.profile == 3 and cfg.compile is True
    import pytest
    with pytest.raises(ConfigError, match="profile must be >= 0"):
        load_config(None, {"profile": "-1"})
