"""``mixprec plan``: choose a format per Linear layer for a training set-up, write the plan file.

Builds the model and data of ``mixprec train`` (same settings: ``--config``, ``key=value``),
optionally loads the weights of a run (``--from RUN_DIR``: sensitivities of a trained model differ
from those at initialisation), takes ``--batches`` calibration batches from the training data and
runs :func:`mixprec.plan.plan_precision`. Writes the plan (``-o``, default ``plan.json``) and a PNG
beside it; train with it via ``mixprec train model=... --precision plan:plan.json`` (the plan
records the model settings and Linear layers it was made for; another model is refused).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from mixprec.errors import ConfigError

__all__ = ["configure", "run"]


def percent(text: str) -> float:
    """``--budget``'s value: a number of percent, with or without its ``%`` sign."""
    return float(text.strip().removesuffix("%"))


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("settings", nargs="*", metavar="KEY=VALUE",
                        help="training settings (model=small, seq_len=128, batch_size=..., see "
                             "`mixprec train --list`)")
    parser.add_argument("--config", metavar="FILE", help="TOML file with training settings")
    parser.add_argument("--candidates", default="fp32,bf16,fp8-tensorwise,fp8-blockwise",
                        help="comma-separated formats to choose from (fp32 is always one; also "
                             "fp8-rowwise, mxfp8, nvfp4, mxfp4: plan those for --target B200)")
    parser.add_argument("--budget", type=percent, default=0.1,
                        help="allowed relative loss change of the whole plan against FP32, in percent "
                             "of the loss (default 0.1), measured with the planned formats on "
                             "held-out batches (and the calibration ones); a forward pass, not the "
                             "end-of-training difference, see docs/per-layer.md")
    parser.add_argument("--base", default=None,
                        help="mode outside the planned Linears (default: the precision setting, "
                             "auto = best safe mode here)")
    parser.add_argument("--target", default=None,
                        help="'measure' (this machine's GEMM throughput) or a GPU (H100, H200, "
                             "H800, A100, B200, GB200); default: measure on an FP8 GPU, else H100")
    parser.add_argument("--criterion", choices=("fisher", "measured"), default="fisher",
                        help="rank the first choice by the estimated (fisher, default) or the "
                             "single-layer measured loss change; the whole plan is then measured "
                             "and layers moved back until it fits the budget (docs/per-layer.md)")
    parser.add_argument("--batches", type=int, default=3,
                        help="batches of the training data (batch_size x seq_len of the settings); "
                             "the last third (at least one of two or more) is held out for the "
                             "whole-plan check (default 3)")
    parser.add_argument("--from", dest="from_run", metavar="RUN_DIR",
                        help="load the model weights of this run's latest checkpoint")
    parser.add_argument("-o", "--output", default="plan.json", help="plan file (.json or .toml)")
    parser.add_argument("--png", default=None, help="plot (default: the plan file's name, .png)")
    add_limit_flags(parser)


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """``--min-sqnr`` / ``--max-flush``: a user's limits for every format (``mixprec plan`` and
    ``mixprec whatif``; ``mixprec train`` has ``guard_min_sqnr=`` / ``guard_max_flush=``)."""
    parser.add_argument("--min-sqnr", type=float, default=None, metavar="DB",
                        help="refuse a format for a layer whose output SQNR is below this, for every "
                             "format, as given (default: each format's own limit, the guard's too; "
                             "docs/per-layer.md)")
    parser.add_argument("--max-flush", type=float, default=None, metavar="PERCENT",
                        help="refuse a format that flushes or saturates more than this percent of a "
                             "layer's inputs, for every format, as given (default: each format's own)")


def limit_args(args: argparse.Namespace) -> dict[str, float | None]:
    """``min_sqnr_db`` / ``max_flush`` of :func:`add_limit_flags`'s flags, checked."""
    if args.max_flush is not None and not 0 <= args.max_flush <= 100:
        raise ConfigError(f"--max-flush is in percent of a layer's inputs, in [0, 100], got {args.max_flush:g}")
    return {"min_sqnr_db": args.min_sqnr,
            "max_flush": None if args.max_flush is None else args.max_flush / 100}


def settings_file(config: str | None, from_run: str | None) -> str | None:
    """The settings file to read: ``--config``, else (with ``--from``) the run's own
    ``config.toml``, so its model is the one its weights fit; said in one line."""
    if config is not None or not from_run:
        return config
    given = Path(from_run)
    for folder in (given, *given.parents[:2]):        # RUN, or RUN/checkpoints/step-N
        if (folder / "config.toml").is_file():
            print(f"[mixprec] settings: {folder / 'config.toml'} (the run's own), then the command line",
                  file=sys.stderr)
            return str(folder / "config.toml")
    return None


def say_untrained(from_run: str | None) -> None:
    """One line when the measured model is untrained: its loss is near ln(vocabulary) and every
    format looks harmless there."""
    if not from_run:
        print("[mixprec] note: these are initial, untrained weights, on which every format looks "
              "harmless; measure a trained model with --from RUN_DIR", file=sys.stderr)


def model_and_batches(cfg, from_run: str | None, n: int) -> tuple[Any, list, Any]:
    """The settings' model (with a run's weights when ``from_run``), its first ``n`` training
    batches and the strategy: what ``mixprec plan`` and ``mixprec whatif`` measure on."""
    from mixprec.cli.train import build_run
    model, train_loader, _, strategy = build_run(cfg)
    if from_run:
        from mixprec.runs.checkpoint import load_checkpoint
        state, _, _ = load_checkpoint(from_run)
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            first = str(e).strip().splitlines()[-1].strip().rstrip(".")
            raise ConfigError(f"the weights in {from_run} do not fit the model of these settings "
                              f"(model={cfg.model}, seq_len={cfg.seq_len}): {first}; give the run's own "
                              "settings (--config RUN/config.toml) or drop the settings that differ") from None
    batches = []
    for batch in train_loader:
        batches.append(batch)
        if len(batches) == n:
            break
    return model, batches, strategy


MODEL_SETTINGS = ("model", "vocab_size", "num_layers", "d_model", "num_heads", "num_experts")
"""The settings that decide a model's Linear layers (a plan records them, its hint repeats them)."""


def model_settings(cfg) -> str:
    """``"model=tiny"`` (and any other of :data:`MODEL_SETTINGS` set): what a plan was made for."""
    return " ".join(f"{k}={getattr(cfg, k)}" for k in MODEL_SETTINGS if getattr(cfg, k, None) is not None)


def run(args: argparse.Namespace) -> int:
    from mixprec.plan.planner import plan_precision, split_heldout
    from mixprec.train.config import load_config, parse_overrides
    if args.batches < 1:
        raise ConfigError("--batches must be >= 1")
    if not 0 <= args.budget < 100:
        raise ConfigError(f"--budget is in percent of the loss, in [0, 100) (e.g. 0.1 for 0.1 %), "
                          f"got {args.budget:g}")
    limits = limit_args(args)
    cfg, _ = load_config(settings_file(args.config, args.from_run), parse_overrides(args.settings))
    model, batches, strategy = model_and_batches(cfg, args.from_run, args.batches)
    base = args.base or cfg.precision
    print(f"[mixprec] planning the Linear layers of model "
          f"{cfg.model} on {len(batches)} batches of {cfg.batch_size}x{cfg.seq_len} tokens "
          f"({len(split_heldout(batches, None)[1])} held out) "
          f"(weights: {args.from_run or 'initialisation, seed ' + str(cfg.seed)})", file=sys.stderr)
    say_untrained(args.from_run)
    plan = plan_precision(model, batches, candidates=args.candidates.split(","),
                          budget=args.budget / 100, base=base, target=args.target, seed=cfg.seed,
                          criterion=args.criterion, **limits,
                          progress=lambda s: print(f"[mixprec] measured {s}", file=sys.stderr))
    plan.made_for = model_settings(cfg)
    print(plan.table())
    print(f"[mixprec] trade-off: {plan.tradeoff()}", file=sys.stderr)
    out = plan.write(args.output)
    png = plan.plot(args.png or Path(args.output).with_suffix(".png"))
    print(f"[mixprec] plan: {out}  plot: {png}", file=sys.stderr)
    print(f"[mixprec] train with it: mixprec train {plan.made_for} --precision plan:{out}", file=sys.stderr)
    strategy.teardown()
    return 0
