"""``mixprec memory``'s estimate beside the measured peak of the same training step, per mode.

    python3 benchmarks/gpu/memory_vs_estimate.py                 # GPU: gpt2-355m, batch 4 x 1024
    python3 benchmarks/gpu/memory_vs_estimate.py --cpu-smoke     # CPU: a tiny model, seconds

The measured peak is ``bench train``'s (one fresh process per mode, a few ``Trainer.train_step``
calls): on CUDA ``torch.cuda.max_memory_allocated``, the allocator's peak, which is what the
estimator models; on a CPU the peak RSS growth, which counts allocator slack and is shown only to
check the script. Prints a markdown table; exits 1 when a GPU mode is off by more than
``--tolerance`` (10 %), so benchmarks/gpu/run_all.py records the stage as failed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mixprec.bench.model_spec import model_config  # noqa: E402
from mixprec.bench.modes import TrainBenchConfig, measure_peak_memory  # noqa: E402
from mixprec.estimate.memory import ModelShape, estimate_memory  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-355m")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--modes", default="32-true,bf16-mixed,bf16-true")
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU (checks the script)")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.model, args.batch, args.seq, device = "tiny", 2, 32, "cpu"
    else:
        device = "cuda"
    mcfg = model_config(args.model)
    shape = ModelShape.from_config(mcfg.replace(max_seq_len=max(args.seq, mcfg.max_seq_len)))
    print(f"{args.model}, batch {args.batch} x {args.seq}, {device}"
          + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else ""), flush=True)
    print("\n| mode | estimated MiB | measured MiB | estimate vs measured |\n|---|---|---|---|")
    off = []
    for mode in args.modes.split(","):
        cfg = TrainBenchConfig(model=args.model, modes=(mode,), batch=args.batch, seq=args.seq, device=device)
        measured = measure_peak_memory(mode, cfg, steps=3, timeout=120)
        est = estimate_memory(shape, mode, batch=args.batch, seq=args.seq, device=device).peak
        if measured is None:
            print(f"| {mode} | {est / 2**20:.0f} | not measured | - |", flush=True)
            off.append(mode)
            continue
        rel = (est - measured) / measured
        if abs(rel) > args.tolerance:
            off.append(mode)
        print(f"| {mode} | {est / 2**20:.0f} | {measured / 2**20:.0f} | {100 * rel:+.1f} % |", flush=True)
    what = "allocator peak" if device == "cuda" else "peak RSS growth (CPU: not what the estimate models)"
    print(f"\nmeasured: {what}; tolerance {100 * args.tolerance:.0f} %"
          + (f"; outside it: {', '.join(off)}" if off else ""))
    return 1 if off and device == "cuda" else 0


if __name__ == "__main__":
    sys.exit(main())
