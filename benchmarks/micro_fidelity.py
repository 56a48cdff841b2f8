"""Final validation loss of the micro formats (MXFP8, MXFP4, NVFP4 and NVFP4 without each of its
recipe's options) against ``32-true`` and ``bf16-mixed``, per seed.

Each run is a separate ``mixprec train`` process with parity.md's settings (built-in corpus,
batch 8 x 64 tokens, AdamW, peak LR 3e-3, warm-up steps // 10, final validation over 40 batches,
same seed and data order for every mode). The micro formats run with FP32 around their GEMMs
(base ``32-true`` and the override ``*=FORMAT``): their GEMMs do not use the surrounding compute
dtype, and BF16 is emulated, tens of times slower, on CPUs without BF16 instructions. The NVFP4
recipe's "last blocks in BF16" is then written as an explicit ``fp32`` override of the last
``ceil(16 %)`` of the blocks (an explicit ``nvfp4`` override is otherwise obeyed as written).

    python benchmarks/micro_fidelity.py --model tiny --steps 1000 --batch 4 --seeds 0,1,2 \
        --modes 32-true,nvfp4,bf16-mixed,mxfp8,nvfp4-plain,mxfp4 --json runs.jsonl
    python benchmarks/micro_fidelity.py --model tiny --steps 1000 --summarize runs.jsonl

Seeds run in the outer loop and the modes alternate inside it; on a machine with more cores, run
one process per seed (``--seeds 0``, ``--seeds 1``, ... with the same ``--json``) and summarize.
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mixprec.models import get_model_config
from mixprec.runs.metrics import read_metrics

_OFF = {"rht": "hadamard_wgrad=false", "2d": "weight_2d=false", "sr": "stochastic_grad=false"}


def mode_args(mode: str, num_layers: int) -> list[str]:
    """``mixprec train`` arguments of a mode: a preset, ``lean``, or
    FORMAT[-plain|-no-rht|-no-2d|-no-sr|-no-keep]."""
    if mode in ("32-true", "bf16-mixed"):
        return ["--precision", mode]
    if mode == "lean":   # every lean option of docs/lean.md: split masters (bf16-true's default) + int8
        # moments + FP8-stored activations + the chunked loss (4 slices of a 4 x 32 batch)
        return ["--precision", "bf16-true", "moments=int8", "fp8_activations=true", "loss_chunk=32"]
    fmt, _, variant = mode.partition("-")
    last = math.ceil(0.16 * num_layers)
    keep = fmt == "nvfp4" and variant not in ("plain", "no-keep")
    over = "".join(f"blocks.{i}.*=fp32," for i in range(num_layers - last, num_layers)) if keep else ""
    out = ["--precision", "32-true", f"precision_overrides={over}*={fmt}"]
    opts = list(_OFF.values()) if variant == "plain" else \
        [_OFF[variant.removeprefix("no-")]] if variant.removeprefix("no-") in _OFF else []
    if opts:
        out.append("micro_options=" + ",".join(opts))
    return out


def train(mode: str, seed: int, args: argparse.Namespace, run_dir: str) -> dict:
    layers = get_model_config(args.model).num_layers
    cmd = [sys.executable, "-m", "mixprec", "train", *mode_args(mode, layers),
           f"model={args.model}", f"max_steps={args.steps}", f"seq_len={args.seq}",
           f"batch_size={args.batch}", "eval_interval=0", f"eval_batches={args.eval_batches}",
           "ckpt_interval=0", "log_interval=1", f"lr={args.lr}", f"warmup_steps={args.steps // 10}",
           "progress=false", "audit=false", f"seed={seed}", f"run_dir={run_dir}"]
    start = time.perf_counter()
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(cmd, capture_output=True, text=True)
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        return {"mode": mode, "seed": seed, "val": math.nan, "rc": done.returncode}
    rows = read_metrics(run_dir)
    vals = [float(r["val_loss"]) for r in rows if r.get("val_loss") not in (None, "")]
    skipped = max((int(r.get("skipped_total") or 0) for r in rows), default=0)
    losses = [float(r["loss"]) for r in rows if r.get("loss") not in (None, "")]
    last = losses[-100:]
    return {"mode": mode, "seed": seed, "val": vals[-1] if vals else math.nan, "rc": 0,
            "final": losses[-1] if losses else math.nan,
            "last100": statistics.fmean(last) if last else math.nan,
            "finite": all(math.isfinite(v) for v in losses), "skipped": skipped,
            "wall_s": time.perf_counter() - start, "cpu_s": cpu_s, "cmd": " ".join(cmd[1:])}


def _ms(vals: list[float]) -> str:
    vals = [v for v in vals if math.isfinite(v)]
    if not vals:
        return "n/a"
    sd = statistics.stdev(vals) if len(vals) > 1 else math.nan
    return f"{statistics.fmean(vals):.4f} ± {sd:.4f}"


def summarize(results: list[dict], args: argparse.Namespace) -> None:
    """Per mode: mean ± sd over seeds of the final validation loss, the final training loss and
    the mean training loss of the last 100 steps; the change of the validation mean against the
    reference (``--reference``); the noise band is the reference's and ``32-true``'s sd."""
    by: dict[str, list[dict]] = {}
    for r in results:
        by.setdefault(r["mode"], []).append(r)
    print(f"\n{args.model}, {args.steps} steps, batch {args.batch} x {args.seq}, lr {args.lr}, "
          f"seeds {args.seeds}")
    print(f"| mode | runs | val loss | final train loss | last-100 train loss | val vs {args.reference} "
          f"| non-finite / skipped | CPU s per run |")
    print("|---|---|---|---|---|---|---|---|")
    ref = [r["val"] for r in by.get(args.reference, [])]
    ref_mean = statistics.fmean(ref) if ref else math.nan
    for mode, rs in by.items():
        val = [r["val"] for r in rs]
        rel = 100 * (statistics.fmean(val) / ref_mean - 1) if ref else math.nan
        bad = sum(not r.get("finite", True) for r in rs), sum(r.get("skipped", 0) for r in rs)
        print(f"| {mode} | {len(rs)} | {_ms(val)} | {_ms([r.get('final', math.nan) for r in rs])} | "
              f"{_ms([r.get('last100', math.nan) for r in rs])} | {rel:+.2f}% | {bad[0]} / {bad[1]} | "
              f"{statistics.fmean(r.get('cpu_s', math.nan) for r in rs):.0f} |")


def compare_at_step(run_dirs: list[str], window: int = 100) -> None:
    """Runs stopped before their end (or finished): the mean training loss over the ``window``
    steps up to the last step every run reached, per run (same seed: the same batches)."""
    rows = {Path(d).name: [r for r in read_metrics(d) if r.get("loss") not in (None, "")] for d in run_dirs}
    n = min(int(rs[-1]["step"]) for rs in rows.values() if rs)
    print(f"\nmean training loss over steps {n - window + 1}-{n} (the last step all {len(rows)} runs reached)")
    print("| run | last step reached | train loss, mean of the window | final val loss |")
    print("|---|---|---|---|")
    for name, rs in rows.items():
        win = [float(r["loss"]) for r in rs if n - window < int(r["step"]) <= n]
        vals = [float(r["val_loss"]) for r in read_metrics(run_dirs[list(rows).index(name)])
                if r.get("val_loss") not in (None, "")]
        print(f"| {name} | {rs[-1]['step']} | {statistics.fmean(win):.4f} | "
              f"{f'{vals[-1]:.4f}' if vals else 'not reached'} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="32-true,mxfp8,mxfp4,nvfp4,nvfp4-plain")
    p.add_argument("--seeds", default="0")
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-batches", type=int, default=40)
    p.add_argument("--json", default=None, help="append one JSON line per run here")
    p.add_argument("--reference", default="bf16-mixed",
                   help="the mode the others are compared with (32-true where BF16 is too slow)")
    p.add_argument("--summarize", default=None, metavar="JSONL",
                   help="only print the table of the runs in this --json file")
    p.add_argument("--compare-at-step", nargs="+", default=None, metavar="RUN_DIR",
                   help="only compare these run folders' training loss at the last step all reached")
    args = p.parse_args()
    if args.compare_at_step:
        compare_at_step(args.compare_at_step)
        return 0
    if args.summarize:
        rows = [json.loads(line) for line in Path(args.summarize).read_text().splitlines() if line]
        summarize([r for r in rows if r.get("model", args.model) == args.model
                   and r.get("steps", args.steps) == args.steps], args)
        return 0
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in [int(s) for s in args.seeds.split(",")]:
            for mode in args.modes.split(","):
                r = train(mode, seed, args, str(Path(tmp) / f"{mode}-{seed}"))
                results.append(r)
                print(json.dumps(r), flush=True)
                if args.json:
                    with open(args.json, "a") as fh:
                        fh.write(json.dumps({**r, "model": args.model, "steps": args.steps}) + "\n")
    summarize(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
