"""overlap_optimizer on a GPU: the overlapped vs the plain step, and where a step's time goes.

    python benchmarks/gpu/overlap_step.py            # ~4-6 minutes on one H200
    python benchmarks/gpu/overlap_step.py --cpu-smoke  # under a minute: checks the script on a CPU

A GPT-2-small-shaped mixprec Transformer (12 layers, d_model 768, 12 heads, vocab 50304, tied
embeddings, seq 1024: ~124M parameters) is trained by ``Trainer.train_step`` in ``bf16-mixed``
and ``bf16-true`` (FP32 masters) at gradient accumulation 1 and 4, once with the plain step and
once with ``overlap_optimizer=true``. The two variants start from the same weights, step on the
same fixed batch and are timed in alternation (the order flips every round; CUDA synchronised
around each sample), so they also take the same number of steps: their weights must then be
bit-identical, which the script checks and reports. Finally one overlapped bf16-mixed step is
profiled (``profile.txt``: self time per category and the mixprec ranges; ``trace.json``: the
Chrome trace, where the side stream's update kernels should run beside the next forward's).

Writes ``overlap_step.json``, ``profile.txt`` and ``trace.json`` to ``$OUT`` (or ``./bench-out``).
``--budget-s`` (default 420) skips what would not fit and says so.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mixprec.models import Transformer  # noqa: E402
from mixprec.models.config import get_model_config  # noqa: E402
from mixprec.monitor.profile import StepProfiler  # noqa: E402
from mixprec.train.config import FitConfig  # noqa: E402
from mixprec.train.trainer import Trainer  # noqa: E402

T0 = time.perf_counter()


def _model_cfg(smoke: bool):
    base = get_model_config("gpt-ref")
    if smoke:
        return base.replace(num_layers=2, d_model=64, num_heads=4, vocab_size=256, max_seq_len=32)
    return base.replace(num_layers=12, d_model=768, num_heads=12, vocab_size=50304, max_seq_len=1024,
                        tie_embeddings=True)


def _trainer(mode: str, overlap: bool, accum: int, mcfg, device: torch.device) -> Trainer:
    torch.manual_seed(0)
    model = Transformer.from_config(mcfg)
    cfg = FitConfig(precision=mode, overlap_optimizer=overlap, grad_accum_steps=accum, lr=1e-4,
                    warmup_steps=0, clip_grad_norm=1.0, log_interval=10**9, audit=False,
                    progress=False, trace_nonfinite=False)
    t = Trainer(model, config=cfg, strategy="single")
    t.prepare(total_steps=10**6)
    t.model.train()
    return t


def result_line(row: dict, device_type: str) -> str:
    """One result line. On a CPU there is no side stream (the same per-module schedule runs in
    order, on the host), so overlapped/plain measures noise, not overlap: no ratio is printed there
    (the --cpu-smoke summary said "overlapped/plain 0.722" for a step that overlapped nothing)."""
    head = (f"{row['mode']:<11} accum {row['accum']}: plain {row['plain_ms']:.1f} ms, overlapped "
            f"{row['overlap_ms']:.1f} ms, ")
    if device_type != "cuda":
        ratio = "overlapped/plain: not meaningful on a CPU (no side stream: nothing overlaps)"
    else:
        ratio = (f"overlapped/plain {row['ratio_median']:.3f} "
                 f"({row['ratio_min']:.3f}-{row['ratio_max']:.3f})")
    return f"{head}{ratio}, bit-identical: {row['bit_identical']}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="steps per timing sample")
    ap.add_argument("--budget-s", type=float, default=420.0)
    args = ap.parse_args()
    smoke = args.cpu_smoke
    device = torch.device("cpu" if smoke else "cuda")
    out = Path(os.environ.get("OUT", "bench-out"))
    out.mkdir(parents=True, exist_ok=True)
    mcfg = _model_cfg(smoke)
    batch = 2 if smoke else args.batch
    seq = mcfg.max_seq_len
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, mcfg.vocab_size, (batch, seq), generator=g).to(device)
    y = torch.randint(0, mcfg.vocab_size, (batch, seq), generator=g).to(device)
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "batch": batch, "seq": seq, "results": []}
    print(f"{info['device']}, torch {torch.__version__}, batch {batch} x {seq}", flush=True)
    for mode in ("bf16-mixed", "bf16-true"):
        for accum in (1, 4):
            if time.perf_counter() - T0 > args.budget_s * 0.8:
                print(f"skipped {mode} accum {accum}: time budget", flush=True)
                continue
            pair = [_trainer(mode, o, accum, mcfg, device) for o in (False, True)]
            if mode == "bf16-mixed" and accum == 1:
                params = sum(p.numel() for p in pair[0].raw_model.parameters())
                info["params_m"] = params / 1e6
                print(f"model: {params / 1e6:.1f}M parameters", flush=True)
            micro = [(x, y)] * accum
            for t in pair:                         # warm-up (lazy state, allocator, autotuning)
                for _ in range(2):
                    t.train_step(micro)
            times: dict[int, list[float]] = {0: [], 1: []}
            ratios = []
            for r in range(args.rounds):
                this = {}
                for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                    _sync(device)
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        pair[i].train_step(micro)
                    _sync(device)
                    this[i] = (time.perf_counter() - t0) / args.steps
                    times[i].append(this[i])
                ratios.append(this[1] / this[0])
            pair[1].settle()
            _sync(device)
            same = all(torch.equal(p, q) for p, q in zip(pair[0].raw_model.parameters(),
                                                          pair[1].raw_model.parameters()))
            row = {"mode": mode, "accum": accum,
                   "plain_ms": statistics.median(times[0]) * 1e3,
                   "overlap_ms": statistics.median(times[1]) * 1e3,
                   "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                   "ratio_max": max(ratios), "bit_identical": same,
                   "groups": sum(1 for gr in pair[1].overlap.groups if gr)}
            info["results"].append(row)
            print(result_line(row, device.type), flush=True)
            del pair
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if time.perf_counter() - T0 < args.budget_s * 0.9:
        t = _trainer("bf16-mixed", True, 1, mcfg, device)
        prof = StepProfiler(3, out, device=device, warmup=2)
        while not prof.done:
            with prof.step():
                t.train_step([(x, y)])
        print(prof.summary.table(), flush=True)
    else:
        print("skipped the profile: time budget", flush=True)
    (out / "overlap_step.json").write_text(json.dumps(info, indent=2))
    print(f"wrote {out / 'overlap_step.json'} ({time.perf_counter() - T0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
