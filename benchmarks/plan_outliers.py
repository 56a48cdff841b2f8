"""Issue 15's planner check on a model with activation outliers: plan vs uniform FP8 vs bf16-mixed.

Large language models grow a few activation channels 10^3-10^4 times larger than the rest, with
correspondingly small weights, and one per-tensor FP8 scale then spends the whole E4M3 range on
those few channels. This benchmark injects that into one chosen Linear of mixprec's Transformer:

* three input channels of the chosen Linear are multiplied by ``--gain`` (1e4) on the way in (a
  forward pre-hook; FP8 conversion and per-layer formats carry a layer's hooks over to the module
  that replaces it), and
* the matching weight columns are divided by the gain at initialisation and frozen (their
  gradient is zeroed), so the model computes exactly what it computed before in FP32 and BF16, and
  AdamW, whose update size does not follow a weight's scale, cannot blow those columns up.

Then per seed, on the same initial weights and data order, it trains with the trainer of
``mixprec train`` (built-in corpus, parity.py's settings): ``bf16-mixed``, uniform FP8 recipes,
and plans (``PLANS``): ``mixprec.plan.plan_precision`` run on the initial model (2 calibration
batches), saved as a plan file and trained with ``plan:PATH``. Prints
what the planner chose per seed and one Markdown table of final validation losses against
``bf16-mixed``.

    python benchmarks/plan_outliers.py --model small --layer blocks.1.mlp.proj --steps 1000 \
        --seeds 0,1,2 --modes bf16-mixed,32-true,fp8-tensorwise,fp8-blockwise,plan,plan-tensorwise
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

OUTLIER_CHANNELS = (3, 22, 45)


def inject_outliers(model: nn.Module, layer: str, channels: Sequence[int] = OUTLIER_CHANNELS,
                    gain: float = 1e4) -> None:
    """Make ``channels`` of ``layer``'s input ``gain`` times larger and its matching weight columns
    ``gain`` times smaller (frozen), leaving the function of the model unchanged (module doc)."""
    linear = model.get_submodule(layer)
    if not isinstance(linear, nn.Linear):
        raise SystemExit(f"plan_outliers: {layer} is not a Linear layer")
    idx = torch.tensor(channels, dtype=torch.long, device=linear.weight.device)
    boost = torch.ones(linear.in_features, device=linear.weight.device)
    boost[idx] = gain

    def boost_input(module, args):
        x, *rest = args
        return (x * boost.to(x.dtype), *rest)

    def freeze_columns(grad):
        return grad.index_fill(1, idx.to(grad.device), 0.0)

    with torch.no_grad():
        linear.weight[:, idx] /= gain
    linear.register_forward_pre_hook(boost_input)   # carried over when the Linear is swapped
    linear.weight.register_hook(freeze_columns)


def _config(args, mode: str, seed: int, run_dir: str, guard: bool = False):
    from mixprec.train.config import TrainConfig
    overrides: tuple[tuple[str, str], ...] = ()
    if mode in KEPT:                 # what the guard ends with, from step 1
        mode, overrides = KEPT[mode], ((args.layer, "bf16"),)
    return TrainConfig(model=args.model, precision=mode, precision_overrides=overrides, max_steps=args.steps, seq_len=args.seq,
                       batch_size=args.batch, eval_interval=0, eval_batches=args.eval_batches,
                       ckpt_interval=0, log_interval=10, lr=args.lr,
                       warmup_steps=args.steps // 10, progress=False, seed=seed, run_dir=run_dir,
                       guard=guard, guard_every=args.guard_every, audit=False)


GUARDED = {"guard-fp8-tensorwise": "fp8-tensorwise", "guard-fp8-blockwise": "fp8-blockwise"}
"""Uniform FP8 with ``guard=true`` (mixprec/monitor/guard.py)."""

KEPT = {"keep-fp8-tensorwise": "fp8-tensorwise", "keep-fp8-blockwise": "fp8-blockwise"}
"""Uniform FP8 with the outlier layer in bf16 from step 1 (a precision override): the formats a
guarded run ends with, without its first steps in FP8."""


PLANS = {
    # mode: (candidates, budget rule)
    "plan": (None, "given"),
    "plan-tensorwise": ("fp32,bf16,fp8-tensorwise", "drop-worst"),
}
"""``plan``: the planner as a user runs it (``--candidates``, ``--budget``). ``plan-tensorwise``: FP8
only as ``fp8-tensorwise``, and the budget set to 99 % of the estimated loss change of putting
every layer in its fastest format, so the layer with the worst estimated loss per time saved
stays out of FP8 and everything else goes in: the rule is fixed before any training run."""


def make_plan(args, mode: str, seed: int, path: Path):
    """Plan on the seed's initial weights, outliers injected, 2 batches of the training data."""
    from mixprec.plan import plan_precision
    from mixprec.plan.plan import choose
    from mixprec.cli.train import build_run
    candidates, rule = PLANS[mode]
    cfg = _config(args, "bf16-mixed", seed, str(path.parent / f"unused-{seed}"))
    model, train_loader, _, strategy = build_run(cfg)
    inject_outliers(model, args.layer, gain=args.gain)
    batches = [b for _, b in zip(range(2), train_loader)]
    cands = (candidates or args.candidates).split(",")
    plan = plan_precision(model, batches, candidates=cands, budget=args.budget / 100,
                          base="bf16-mixed", seed=seed)
    if rule == "drop-worst":      # re-chosen on the estimate alone (no whole-plan check)
        plan.budget = 1.0 - 1e-9          # everything fits: the change of the fastest plan ...
        choose(plan, cands)
        plan.budget = 0.99 * plan.spent         # ... less 1 %: the worst move no longer fits
        choose(plan, cands)
    strategy.teardown()
    plan.write(path)
    return plan


def train(args, mode: str, seed: int, run_dir: str) -> dict:
    from mixprec.cli.train import build_run
    from mixprec.errors import TrainingDiverged
    from mixprec.report.report import guard_summary
    from mixprec.runs.metrics import read_events
    from mixprec.train.trainer import Trainer
    cfg = _config(args, GUARDED.get(mode, mode), seed, run_dir, guard=mode in GUARDED)
    model, train_loader, val_loader, strategy = build_run(cfg)
    inject_outliers(model, args.layer, gain=args.gain)
    start = time.perf_counter()
    trainer = Trainer(model, config=cfg, strategy=strategy)
    try:
        result = trainer.fit(train_loader, val_loader)
        val, skipped = result.final_val_loss, result.skipped_steps
    except TrainingDiverged as e:              # uniform FP8 may diverge: that is a result too
        print(f"[plan_outliers] {mode} seed {seed}: {e}", file=sys.stderr)
        val, skipped = float("nan"), trainer.precision.scaler.num_skipped_steps
    strategy.teardown()
    events = read_events(run_dir)
    formats = next(e["layers"] for e in events if e.get("kind") == "formats")
    return {"val": val, "skipped": skipped, "formats": formats,
            "final_formats": dict(trainer.precision.layers.formats),
            "guard": guard_summary(events), "wall_s": time.perf_counter() - start}


def probe(args) -> None:
    """One forward per gain, before any training: the outlier layer's output SQNR against FP32 and
    the share of its input that ``fp8-tensorwise`` flushes to zero (the guard's own measurement,
    :meth:`mixprec.monitor.guard.TrainingGuard.sample_sqnr`), and the loss change of uniform
    ``fp8-tensorwise`` over ``32-true`` on the same batch."""
    from mixprec.cli.train import build_run
    from mixprec.monitor.guard import TrainingGuard
    from mixprec.train.trainer import Trainer
    print(f"| gain | {args.layer} output SQNR (dB) | its input flushed | median SQNR of the "
          f"other FP8 layers (dB) | one-forward loss, fp8-tensorwise vs 32-true |")
    print("|---|---|---|---|---|")
    for gain in (float(g) for g in args.probe.split(",")):
        losses = {}
        for mode in ("32-true", "fp8-tensorwise"):
            cfg = _config(args, mode, 0, None)
            model, train_loader, _, strategy = build_run(cfg)
            inject_outliers(model, args.layer, gain=gain)
            trainer = Trainer(model, config=cfg, strategy=strategy)
            trainer.prepare(total_steps=args.steps)
            batch = next(iter(train_loader))
            with torch.no_grad():
                losses[mode] = float(trainer.batch_loss(trainer.model, batch)[0])
            if mode != "32-true":
                guard = TrainingGuard(trainer.precision, strategy.unwrap(trainer.model),
                                      trainer.optimizer, trainer.scheduler)
                sqnr = guard.sample_sqnr(lambda: trainer._forward([batch]))
                others = sorted(v for n, v in sqnr.items() if n != args.layer)
                layer_db, flushed = sqnr[args.layer], guard.last_flush[args.layer]
            strategy.teardown()
        change = 100 * (losses["fp8-tensorwise"] / losses["32-true"] - 1)
        print(f"| {gain:g} | {layer_db:.1f} | {100 * flushed:.1f} % | "
              f"{statistics.median(others):.1f} | {change:+.3f} % |", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="bf16-mixed,fp8-tensorwise,fp8-blockwise,plan",
                   help="comma-separated policies, 'plan' or 'plan-tensorwise' (planned on the "
                        "initial weights, see PLANS), 'guard-fp8-tensorwise' / "
                        "'guard-fp8-blockwise' (uniform FP8 with guard=true), or plan:PATH; "
                        "bf16-mixed is the reference")
    p.add_argument("--seeds", default="0")
    p.add_argument("--model", default="small")
    p.add_argument("--layer", default="blocks.1.mlp.proj")
    p.add_argument("--gain", type=float, default=1e4)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-batches", type=int, default=40)
    p.add_argument("--candidates", default="fp32,bf16,fp8-tensorwise,fp8-blockwise")
    p.add_argument("--budget", type=float, default=0.1, help="planner budget, percent of the loss")
    p.add_argument("--guard-every", type=int, default=50, help="guard_every of the guard-* modes")
    p.add_argument("--no-reference", action="store_true",
                   help="do not run bf16-mixed (the table then shows the raw validation losses; "
                        "compare with a bf16-mixed run of the same seeds from another invocation)")
    p.add_argument("--probe", default=None, metavar="GAINS",
                   help="only the one-forward check of these comma-separated gains (SQNR, "
                        "flushed share, loss change), no training")
    p.add_argument("--reference", default="bf16-mixed",
                   help="the mode the table compares against (32-true: FP32, fast on a CPU "
                        "without native BF16)")
    args = p.parse_args()
    if args.probe:
        probe(args)
        return 0
    modes = args.modes.split(",")
    if args.reference not in modes and not args.no_reference:
        modes.insert(0, args.reference)
    seeds = [int(s) for s in args.seeds.split(",")]
    res: dict[tuple[str, int], dict] = {}
    flops: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as root:
        for k, seed in enumerate(seeds):
            # Alternate the contenders: each seed starts one mode later (a load change spreads).
            for i, mode in [(i % len(modes), modes[i % len(modes)]) for i in range(k, k + len(modes))]:
                run_mode = mode
                if mode in PLANS:
                    path = Path(root) / f"{mode}-{seed}.json"
                    plan = make_plan(args, mode, seed, path)
                    flops = {m.name: m.flops_per_token for m in plan.layers}
                    print(f"[plan_outliers] seed {seed} {mode} ({plan.seconds:.0f} s):\n{plan.table()}",
                          file=sys.stderr, flush=True)
                    run_mode = f"plan:{path}"
                r = train(args, run_mode, seed, str(Path(root) / f"s{seed}-m{i}"))
                res[mode, seed] = r
                print(f"[plan_outliers] seed {seed} {mode}: val {r['val']:.4f} "
                      f"({r['skipped']} skipped, {r['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    if not flops:
        from mixprec.cli.train import build_run
        model, *_ , strategy = build_run(_config(args, "32-true", 0, None))
        flops = {n: 6 * m.in_features * m.out_features for n, m in model.named_modules()
                 if isinstance(m, nn.Linear)}
        strategy.teardown()
    total = sum(flops.values())
    print(f"\n{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, torch "
          f"{torch.__version__}; model {args.model}, outliers x{args.gain:g} in channels "
          f"{list(OUTLIER_CHANNELS)} of {args.layer}'s input; {args.steps} steps of "
          f"{args.batch}x{args.seq} tokens, seeds {','.join(map(str, seeds))}\n")
    print("| mode | FP8 share of Linear GEMM FLOPs (at the end) | " + " | ".join(
        f"val loss seed {s} (vs {args.reference})" for s in seeds) + " | mean difference (sd) |")
    print("|---" * (3 + len(seeds)) + "|")
    for mode in modes:
        shares, cells, diffs = [], [], []
        for s in seeds:
            fmts = res[mode, s]["final_formats"]
            shares.append(100 * sum(f for n, f in flops.items() if fmts.get(n, "").startswith("fp8-")) / total)
            v = res[mode, s]["val"]
            ref = res[args.reference, s]["val"] if (args.reference, s) in res else v
            diffs.append((v / ref - 1.0) * 100.0)
            cells.append(f"{v:.4f} ({diffs[-1]:+.2f}%)")
        share = f"{min(shares):.1f}%" if min(shares) == max(shares) else f"{min(shares):.1f}-{max(shares):.1f}%"
        sd = f" ({statistics.stdev(diffs):.2f})" if len(diffs) > 1 else ""
        print(f"| {mode} | {share} | " + " | ".join(cells) + f" | {statistics.mean(diffs):+.2f}%{sd} |")
    for mode in modes:
        for s in seeds:
            if mode in GUARDED:
                print(f"\n{mode} seed {s} final: " + ", ".join(
                    f"{n}={f}" for n, f in res[mode, s]["final_formats"].items()), end="")
            fmts = res[mode, s]["formats"]
            print(f"\n{mode} seed {s}: " + ", ".join(f"{n}={f}" for n, f in fmts.items())
                  + (f" (skipped steps: {res[mode, s]['skipped']})" if res[mode, s]["skipped"] else "")
                  + (f"; guard: {res[mode, s]['guard']}" if mode in GUARDED else ""), end="")
            if mode not in PLANS and mode not in GUARDED:
                break
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
