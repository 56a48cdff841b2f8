"""``mixprec bench train``: the training step per precision mode and peers (:mod:`mixprec.bench.modes`)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mixprec.cli.flags import add_batch_size, add_seq_len
from mixprec.bench.modes import (PEERS, TrainBenchConfig, bench_device, bench_train, format_table,
                                 profile_contender, write_csv, write_png)

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="small",
                        help="model preset: tiny, small, gpt-ref, gpt2-124m, gpt2-355m, gpt2-774m; "
                             "fields after a colon change it: gpt2-355m:num_layers=12,max_seq_len=2048")
    parser.add_argument("--modes", default="32-true,bf16-mixed,bf16-true",
                        help="comma-separated precision modes (and peer names)")
    parser.add_argument("--peers", action="store_true",
                        help=f"add the peer loops: {', '.join(PEERS)} (missing packages are skipped)")
    add_batch_size(parser, default=8, help="sequences per step", old=("--batch",))
    add_seq_len(parser, default=128, help="tokens per sequence")
    parser.add_argument("--repeats", type=int, default=5, help="alternated rounds over the modes")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per mode per repeat")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per mode before timing")
    parser.add_argument("--clip", type=float, default=None, help="clip the gradient norm to this value in mixprec modes (default: no clipping)")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-mode memory processes")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (default: torch's); 1 is steadier on a shared machine")
    parser.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available, else cpu)")
    parser.add_argument("--overlap", action="store_true",
                        help="add MODE+overlap (overlap_optimizer=true) after each mode")
    parser.add_argument("--compile", action="store_true",
                        help="add MODE+compile (torch.compile of the model) after each mode; the "
                             "table reports the compile time")
    parser.add_argument("--profile", type=int, nargs="?", const=3, default=0, metavar="STEPS",
                        help="profile STEPS steps (default 3) of the first mode after timing: "
                             "profile.txt (top operators by category) and trace.json in --out")
    parser.add_argument("--out", default="bench-train", help="folder for bench_train.csv and .png")


def run(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for flag in ("overlap", "compile"):
        if getattr(args, flag, False):
            modes = [v for m in modes for v in ((m, f"{m}+{flag}") if m not in PEERS else (m,))]
    if args.peers:
        modes += [p for p in PEERS if p not in modes]
    cfg = TrainBenchConfig(model=args.model, modes=tuple(modes), batch=args.batch_size, seq=args.seq_len,
                           repeats=args.repeats, steps=args.steps, warmup=args.warmup, clip=args.clip,
                           device=args.device, threads=args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = bench_train(cfg, memory=not args.no_memory, log=lambda s: print(f"[bench] {s}", file=sys.stderr))
    print(format_table(rows))
    write_csv(rows, out / "bench_train.csv")
    write_png(rows, out / "bench_train.png",
              f"{cfg.model}, batch {cfg.batch} x {cfg.seq}, {bench_device(cfg).type}, {cfg.repeats} repeat{'s' if cfg.repeats != 1 else ''}")
    print(f"wrote {out / 'bench_train.csv'} and {out / 'bench_train.png'}")
    if args.profile:
        summary = profile_contender(cfg.modes[0], cfg, steps=args.profile, out_dir=out)
        print(f"\nprofile of {cfg.modes[0]} ({cfg.model}, batch {cfg.batch} x {cfg.seq}):")
        print(summary.table())
        print(f"wrote {out / 'profile.txt'} and {out / 'trace.json'}")
    return 0
