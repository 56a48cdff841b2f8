"""``bench matmul`` caps slow (emulated) dtypes from a small probe and reports each size as it ends."""
from __future__ import annotations

import pytest

from mixprec.bench import matmul
from mixprec.cli import bench_matmul as bench_matmul_cmd

GFLOPS = {"fp32": 100e9, "bf16": 200e9, "fp16": 0.4e9}   # fp16 emulated: 0.4 GFLOPS


def fake_timer(calls):
    def timer(label, dtype, device, n, min_time):
        calls.append((label, n))
        return GFLOPS[label]
    return timer


def test_estimate_grows_with_n_cubed_and_respects_min_time():
    assert matmul.estimate_seconds(1e9, 16, repeats=3, min_time=0.2) == pytest.approx(3 * (0.2 + 2 * 2 * 16**3 / 1e9))
    # 2 * 2048**3 / 0.4e9 = 43 s per product; 3 repeats of 5 products: ~11 minutes
    assert matmul.estimate_seconds(0.4e9, 2048, repeats=3, min_time=0.2) > 600


def test_sizes_whose_estimate_exceeds_the_cap_are_skipped_with_a_note():
    calls, seen = [], []
    rows = matmul.bench_matmul(["fp32", "bf16", "fp16"], [512, 2048], device="cpu", repeats=3,
                               max_seconds=60, timer=fake_timer(calls),
                               on_size=lambda n, r, notes: seen.append((n, [x["dtype"] for x in r], notes)))
    # fp16 at 512: 3 * (3 * 0.67 s + 2 * 0.67 s) ~ 10 s: measured; at 2048 (~640 s): skipped
    assert {(r["dtype"], r["n"]) for r in rows} == {("fp32", 512), ("bf16", 512), ("fp16", 512),
                                                   ("fp32", 2048), ("bf16", 2048)}
    assert ("fp16", 2048) not in calls
    assert [n for n, _, _ in seen] == [512, 2048]          # reported size by size, smallest first
    (note,) = seen[1][2]
    assert note.startswith("fp16 n=2048 skipped: ~") and "cap 60 s" in note and "0.4 GFLOPS" in note
    assert seen[0][2] == []


def test_no_cap_measures_every_size_and_skips_the_probe():
    calls = []
    rows = matmul.bench_matmul(["fp16"], [2048], device="cpu", repeats=1, max_seconds=None,
                               timer=fake_timer(calls))
    assert [(r["dtype"], r["n"]) for r in rows] == [("fp16", 2048)] and calls == [("fp16", 2048)]


def test_cli_prints_the_note_for_a_capped_size(monkeypatch, capsys):
    import argparse
    calls = []
    parser = argparse.ArgumentParser()
    bench_matmul_cmd.configure(parser)
    args = parser.parse_args(["--dtypes", "fp32,fp16", "--sizes", "64,2048", "--repeats", "1",
                              "--device", "cpu", "--max-seconds", "30"])
    real = matmul.bench_matmul
    monkeypatch.setattr(bench_matmul_cmd, "bench_matmul",
                        lambda *a, **k: real(*a, **k, timer=fake_timer(calls)))
    assert bench_matmul_cmd.run(args) == 0
    out = capsys.readouterr().out
    assert "note: fp16 n=2048 skipped" in out
    lines = out.splitlines()
    assert lines.index(next(l for l in lines if "note:" in l)) > max(
        i for i, l in enumerate(lines) if l.split()[:2] == ["fp32", "64"])
