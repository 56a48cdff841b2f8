"""benchmarks/gpu/run_all.py, the prepared GPU check: its --cpu-smoke form runs every stage end to
end on a CPU; the GPU form fits its 8 minutes; a stage over its budget is stopped and recorded
while the next one runs."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu" / "run_all.py"


def _module():
    spec = importlib.util.spec_from_file_location("run_all", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["run_all"] = mod                   # (its dataclass looks its module up there)
    spec.loader.exec_module(mod)
    return mod


def test_the_gpu_form_fits_8_minutes_and_the_smoke_runs_the_same_stages(tmp_path):
    run_all = _module()
    gpu, smoke = run_all.stages(tmp_path, smoke=False), run_all.stages(tmp_path, smoke=True)
    assert sum(s.budget_s for s in gpu) <= run_all.TOTAL_BUDGET_S == 480
    assert [s.name for s in gpu] == [s.name for s in smoke]
    assert len({s.name for s in gpu}) == len(gpu)
    for node in run_all.REGRESSIONS:                      # the H200 run's failures still exist
        path, name = node.split("::")
        assert f"def {name}(" in (REPO / path).read_text(), node


def test_a_stage_over_its_budget_is_stopped_and_recorded_and_the_next_one_runs(tmp_path):
    run_all = _module()
    (tmp_path / "logs").mkdir()
    slow = run_all.Stage("slow", "sleeps", 0.5, ((sys.executable, "-c", "import time; time.sleep(30)"),),
                         run_all._tail(3))
    bad = run_all.Stage("bad", "exits 3", 5, ((sys.executable, "-c", "print('x'); raise SystemExit(3)"),),
                        run_all._tail(3))
    results = [run_all.run_stage(s, tmp_path, dict(os.environ), s.budget_s) for s in (slow, bad)]
    assert [r["status"] for r in results] == ["timed out", "failed"] and results[0]["seconds"] < 15
    page = run_all.summary(results, smoke=True, started="now", total_s=1.0)
    assert "| slow | sleeps | timed out |" in page and "| bad | exits 3 | failed (rc 3) |" in page
    assert "over the stage's budget" in (tmp_path / "logs" / "slow.log").read_text()


@pytest.mark.slow
def test_the_cpu_smoke_runs_every_stage_end_to_end(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke"], env=env, capture_output=True,
                          text=True, timeout=300)
    page = (tmp_path / "summary.md").read_text()
    assert proc.returncode == 0, page
    names = [s.name for s in _module().stages(tmp_path, smoke=True)]
    for name in names:
        assert f"| {name} |" in page and (tmp_path / "logs" / f"{name}.log").is_file()
    assert f"{len(names)} of {len(names)} stages ok" in page
    assert "tokens/s" in page and "| 32-true |" in page                # train and memory tables
    assert "torchao-float8" in (tmp_path / "logs" / "train-peers.log").read_text()
    assert (tmp_path / "cli-run" / "report" / "report.html").is_file()


def test_the_gpu_forms_mixprec_commands_parse_and_name_valid_modes(tmp_path):
    # What a lent GPU would find first, checked here: flags, presets, modes and variants.
    import argparse

    from mixprec.bench.modes import TrainBenchConfig
    from mixprec.cli import bench_matmul, bench_train
    run_all = _module()
    parsers = {}
    for name, mod in (("train", bench_train), ("matmul", bench_matmul)):
        parsers[name] = argparse.ArgumentParser()
        mod.configure(parsers[name])
    seen = set()
    for stage in run_all.stages(tmp_path, smoke=False):
        for cmd in stage.commands:
            if "bench" not in cmd:
                continue
            kind = cmd[cmd.index("bench") + 1]
            args = parsers[kind].parse_args(list(cmd[cmd.index("bench") + 2:]))
            seen.add(kind)
            if kind == "train":
                TrainBenchConfig(model=args.model, modes=tuple(args.modes.split(",")), device="cuda")
    assert seen == {"train", "matmul"}
