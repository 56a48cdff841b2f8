"""The master-weight optimizer step on a GPU: the fused AdamW kernel vs the twin's foreach step.

    python benchmarks/gpu/master_step.py              # ~1-2 minutes on one H200
    python benchmarks/gpu/master_step.py --cpu-smoke  # seconds: checks the script on a CPU

``mixprec.optim.AdamW.step()`` alone (no forward or backward) over the parameters of the 406M GPT
of issue #35 (24 blocks of d=1024, vocab 50304, BF16, synthetic gradients), per layout (split
masters, full FP32 masters, BF16 moments, int8 moments), once with the flat step's chunk update
as mixprec's Triton kernel (mixprec/optim/adamw_triton.py) and once as the twin's foreach step
(``flat_kernel.KERNEL_DEVICES`` emptied), timed in alternation with CUDA events, median per step. It
also checks that split and full masters through the kernel give the same bits, and prints the
flat step's note per device ("kernel", or why the twin steps: the probe's verdict on this GPU).

Writes ``master_step.json`` to ``$OUT`` (or ``./bench-out``). Not part of run_all.py's budget.
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

from mixprec.optim import AdamW, flat_kernel as flat  # noqa: E402

LAYOUTS = {"split": {}, "full": {"split_masters": False}, "bf16-moments": {"moments": "bf16"},
           "int8-moments": {"moments": "int8"}}


def gpt_shapes(layers: int, d: int, vocab: int) -> list[tuple[int, ...]]:
    per_block = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,), (d,), (d,)]
    return [(vocab, d), *(s for _ in range(layers) for s in per_block), (d,), (d,)]


def run(layout: str, kernel: bool, shapes, device, steps: int, warmup: int, grads_seed: int = 0):
    flat.KERNEL_DEVICES = ("cuda",) if kernel else ()
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(device, torch.bfloat16) * 0.02) for s in shapes]
    grads = [(torch.randn(s, generator=g) * 1e-3).to(device, torch.bfloat16) for s in shapes]
    opt = AdamW(params, lr=1e-4, seed=0, **LAYOUTS[layout])
    for p, gr in zip(params, grads):
        p.grad = gr
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.step()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            opt.step()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    notes = dict(opt._flat.kernel_notes) if opt._flat is not None else {}
    bits = [p.detach().view(torch.int16).clone() for p in params]
    del opt, params, grads
    return times, notes, bits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    device = torch.device("cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda")
    shapes = gpt_shapes(2, 32, 64) if args.cpu_smoke else gpt_shapes(24, 1024, 50304)
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), torch "
          f"{torch.__version__}, {sum(torch.Size(s).numel() for s in shapes) / 1e6:.3f}M parameters")
    results: dict = {}
    for layout in LAYOUTS:
        samples: dict[bool, list[float]] = {True: [], False: []}
        notes: dict[bool, dict] = {}
        bits: dict[bool, list] = {}
        for r in range(args.rounds):
            for kernel in ((True, False) if r % 2 == 0 else (False, True)):   # alternate the order
                t, n, b = run(layout, kernel, shapes, device, args.steps, warmup=2)
                samples[kernel] += t
                notes[kernel], bits[kernel] = n, b
        results[layout] = {"kernel_ms": statistics.median(samples[True]), "twin_ms": statistics.median(samples[False]),
                           "kernel_note": notes[True], "twin_note": notes[False], "bits": bits[True]}
    split_full = all(torch.equal(a, b) for a, b in zip(results["split"]["bits"], results["full"]["bits"]))
    print("| layout | twin ms/step | kernel ms/step | kernel path's note |")
    print("|---|---|---|---|")
    for layout, r in results.items():
        print(f"| {layout} | {r['twin_ms']:.2f} | {r['kernel_ms']:.2f} | {r['kernel_note']} |")
    print(f"split == full through the kernel path (every param, bits): {split_full}")
    if device.type != "cuda":
        print("(on a CPU both columns are the twin's step: the kernel runs on CUDA only)")
    out = Path(os.environ.get("OUT", "bench-out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "master_step.json").write_text(json.dumps(
        {"device": str(device), "split_equals_full": split_full,
         **{k: {kk: vv for kk, vv in v.items() if kk != "bits"} for k, v in results.items()}}, indent=1))


if __name__ == "__main__":
    main()
