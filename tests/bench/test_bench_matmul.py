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
    assert note.startswith("fp16 2048: skipped, ~") and "128x128 probe" in note and "0.4 GFLOP/s" in note
    assert note.endswith("raise --max-seconds") and "of the 60 s budget left" in note
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
    assert "note: fp16 2048: skipped" in out
    assert "  measuring n=64: fp32, fp16 x 1 (~" in out          # progress before each size
    lines = out.splitlines()
    assert lines.index(next(l for l in lines if "note:" in l)) > max(
        i for i, l in enumerate(lines) if l.split()[:2] == ["fp32", "64"])


def test_on_a_gpu_the_probe_fills_it_and_no_size_is_skipped_for_launch_overhead():
    # The H200 run: a 128 x 128 probe timed launches (0.4 TFLOP/s) and every dtype was skipped.
    # On CUDA the probe is a 4096 x 4096 GEMM (fake timer: an H200-like 700 TFLOP/s).
    import torch
    calls = []

    def gpu(label, dtype, device, n, min_time):
        calls.append((label, n, device.type))
        return 700e12 if n >= 1024 else 0.4e12       # a small GEMM on a GPU is launch-bound
    rows = matmul.bench_matmul(["fp32", "bf16"], [4096, 8192], device="cuda", repeats=1,
                               max_seconds=60, timer=gpu)
    assert calls[:2] == [("fp32", 4096, "cuda"), ("bf16", 4096, "cuda")]          # the probes
    assert {(r["dtype"], r["n"]) for r in rows} == {("fp32", 4096), ("bf16", 4096),
                                                   ("fp32", 8192), ("bf16", 8192)}
    assert matmul.probe_size(torch.device("cuda"), [256, 512]) == 512
    assert matmul.probe_size(torch.device("cpu"), [512, 2048]) == 128


class FakeEvent:
    """A CUDA event on a fake device clock: each queued GEMM advances it by ``per_call`` s."""

    clock = 0.0

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        self.at = FakeEvent.clock

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3                    # milliseconds, as torch's


def test_cuda_timing_queues_products_between_events_and_grows_the_batch_to_min_time():
    from mixprec.policy import peak
    per_call, launched = 1e-3, []

    def gemm():
        launched.append(1)
        FakeEvent.clock += per_call
    flops = peak.cuda_flops(gemm, 2.0 * 4096**3, 0.2, event=FakeEvent)
    assert flops == pytest.approx(2.0 * 4096**3 / per_call)
    assert len(launched) >= 200                            # batches grew until one lasted 0.2 s
    assert peak.cuda_seconds(gemm, 5, event=FakeEvent) == pytest.approx(5 * per_call)


class FakeClock:
    """A clock that a fake timer advances by the seconds the real measurement would take."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_cap_holds_when_the_rate_falls_as_n_grows():
    # The trial's CPU: emulated fp16 got slower per FLOP as n grew, so the 128x128 probe alone
    # put 2048 at ~26 s (fits in 60) while it really took minutes. The estimate for each size
    # now uses the worse of the probe's rate and the rate measured at the previous size.
    fp16 = {128: 10e9, 512: 4e9, 1024: 0.94e9, 2048: 0.5e9}
    clock, calls, seen = FakeClock(), [], []

    def timer(label, dtype, device, n, min_time):
        calls.append((label, n))
        flops = 100e9 if label == "fp32" else fp16[n]
        t = 2.0 * n**3 / flops
        clock.now += max(min_time, 3 * t) + 2 * t            # what one measurement costs
        return flops
    rows = matmul.bench_matmul(["fp32", "fp16"], [512, 1024, 2048], device="cpu", repeats=3,
                               max_seconds=60, timer=timer, clock=clock,
                               on_size=lambda n, r, notes: seen.append((n, notes)))
    assert ("fp16", 2048) not in calls and ("fp32", 2048) in calls
    assert clock.now <= 60                                       # the cap held
    assert {(r["dtype"], r["n"]) for r in rows} >= {("fp16", 512), ("fp16", 1024)}
    (note,) = seen[2][1]
    assert note.startswith("fp16 2048: skipped, ~") and "rate measured at n=1024 (0.94 GFLOP/s)" in note


def test_the_cap_is_on_the_whole_run_not_each_size():
    # Each (dtype, size) alone fits in the cap; together they do not: the later ones are skipped.
    clock, calls, starts = FakeClock(), [], []

    def timer(label, dtype, device, n, min_time):
        calls.append((label, n))
        clock.now += 1.0 if n == 128 else 4.0
        return 1e12
    matmul.bench_matmul(["fp32", "bf16"], [256, 512, 1024], device="cpu", repeats=1, min_time=4.0,
                        max_seconds=20, timer=timer, clock=clock,
                        on_start=lambda n, labels, est, left: starts.append((n, labels, est, left)))
    assert clock.now <= 20
    assert starts[0] == (256, ["fp32", "bf16"], pytest.approx(2 * 4.0, rel=0.01), 18.0)
    assert ("bf16", 1024) not in calls


def _cli(argv):
    import argparse
    parser = argparse.ArgumentParser()
    bench_matmul_cmd.configure(parser)
    return parser, parser.parse_args(argv)


def test_a_run_where_no_dtype_can_run_here_exits_non_zero_with_one_line_saying_why(capsys):
    """``--dtypes fp8,tf32`` on a CPU printed an empty table and exited 0."""
    from mixprec.errors import ConfigError
    _, args = _cli(["--dtypes", "fp8,tf32", "--device", "cpu"])
    with pytest.raises(ConfigError) as e:
        bench_matmul_cmd.run(args)
    message = str(e.value)
    assert "\n" not in message and message.startswith("nothing to measure on cpu: ")
    assert "fp8: no FP8 tensor cores on a CPU (they need a GPU of compute capability 8.9+)" in message
    assert "tf32: TF32 is a CUDA tensor-core feature" in message
    assert "dtype" not in capsys.readouterr().out          # no table header for nothing


def test_the_default_run_says_which_dtypes_it_cannot_time_here(monkeypatch, capsys):
    """The default ``--dtypes`` on a CPU dropped tf32 and fp8 without a word."""
    calls = []
    _, args = _cli(["--sizes", "64", "--repeats", "1", "--device", "cpu", "--max-seconds", "0"])
    real = matmul.bench_matmul
    monkeypatch.setattr(bench_matmul_cmd, "bench_matmul",
                        lambda *a, **k: real(*a, **k, timer=fake_timer(calls)))
    assert bench_matmul_cmd.run(args) == 0
    out = capsys.readouterr().out
    assert "note: tf32 not measured: TF32 is a CUDA tensor-core feature" in out
    assert "note: fp8 not measured: no FP8 tensor cores on a CPU" in out
    assert sorted({label for label, _ in calls}) == ["bf16", "fp16", "fp32"]


def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_named_too():
    import torch
    plan, cannot = matmul.plan_dtypes(["fp32", "fp8"], torch.device("cuda"), fp8_here=lambda: False)
    assert plan == [("fp32", torch.float32)]
    assert cannot == [("fp8", "this GPU has no FP8 tensor cores (they need compute capability 8.9+)")]


def test_an_unknown_dtype_suggests_and_lists_what_help_offers():
    """``--dtypes fp9`` suggested fp64 and listed names without fp8/tf32, which ``--help`` offers."""
    import torch
    from mixprec.errors import ConfigError
    parser, _ = _cli([])
    help_text = parser.format_help()
    with pytest.raises(ConfigError) as e:
        matmul.plan_dtypes(["fp9"], torch.device("cpu"))
    assert str(e.value) == ("unknown dtype 'fp9' for bench matmul (did you mean 'fp8'?); valid: "
                            "fp32, tf32, bf16, fp16, fp8")
    assert all(name in help_text for name in matmul.BENCH_DTYPES)
    with pytest.raises(ConfigError, match="valid: fp32, tf32, bf16, fp16, fp8$"):
        matmul.plan_dtypes(["fp64"], torch.device("cpu"))      # a dtype, but not one timed here
    assert matmul.plan_dtypes(["half", "e4m3"], torch.device("cpu"))[0] == [("fp16", torch.float16)]


def test_a_run_whose_every_size_is_over_the_budget_exits_non_zero(monkeypatch, capsys):
    from mixprec.errors import ConfigError
    _, args = _cli(["--dtypes", "fp16", "--sizes", "2048", "--repeats", "1", "--device", "cpu",
                    "--max-seconds", "30"])
    real = matmul.bench_matmul
    monkeypatch.setattr(bench_matmul_cmd, "bench_matmul",
                        lambda *a, **k: real(*a, **k, timer=fake_timer([])))
    with pytest.raises(ConfigError, match="^nothing was measured: every size of every dtype was "
                                          "estimated over the 30 s budget"):
        bench_matmul_cmd.run(args)
    assert "note: fp16 2048: skipped" in capsys.readouterr().out
