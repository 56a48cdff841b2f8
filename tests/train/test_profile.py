"""``profile=STEPS``: a table of where a step's time goes (mixprec's own casts and syncs named),
a Chrome trace in the run folder, and a link to it from ``mixprec report``."""
from __future__ import annotations

import json

import torch

from mixprec.models import Transformer
from mixprec.monitor.profile import categorize
from mixprec.train import report
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
