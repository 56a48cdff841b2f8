"""``mixprec whatif``: which format can each Linear take? One table, a CSV and a heat-map.

Builds the model and data of ``mixprec train`` (same settings: ``--config``, ``key=value``;
``model=hf:PATH`` for a Hugging Face model from a local ``config.json``), optionally loads the
weights of a run (``--from RUN_DIR``), takes ``--batches`` batches of the training data and runs
:func:`mixprec.plan.what_if`. Writes the CSV (``-o``, default ``whatif.csv``) and the heat-map
PNG beside it; ``--plan FILE`` also writes the per-layer choice as a plan file
(``mixprec train --precision plan:FILE``).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from mixprec.cli.plan import add_limit_flags
from mixprec.errors import ConfigError

__all__ = ["configure", "run", "measure_config", "WHATIF_BATCH"]

WHATIF_BATCH = {"batch_size": 8, "seq_len": 64}
"""The batch shape when the settings give none: with ``--batches 2``, 1024 tokens (the time the
docs state was measured at it; training's default, 16 x 128, takes four times as long)."""


def configure(parser: argparse.ArgumentParser) -> None:
    from mixprec.plan.whatif import WHATIF_FORMATS
    parser.add_argument("settings", nargs="*", metavar="KEY=VALUE",
                        help="training settings (model=small, model=hf:PATH, seq_len=128, "
                             "batch_size=..., see `mixprec train --list`)")
    parser.add_argument("--config", metavar="FILE", help="TOML file with training settings")
    parser.add_argument("--formats", default=",".join(WHATIF_FORMATS),
                        help="comma-separated formats, the table's column groups (default: all)")
    parser.add_argument("--gpu", default="B200",
                        help="GPU of the projected speed-ups (B200, GB200, H100, H200, H800, A100)")
    parser.add_argument("--tolerance", type=float, default=0.5,
                        help="a layer is safe in a format when its loss change alone is at most "
                             "this, in percent of the loss (default 0.5)")
    parser.add_argument("--batches", type=int, default=2,
                        help="batches of batch_size x seq_len tokens (default 2; batch_size and "
                             "seq_len default to 8 and 64 here, 1024 tokens in all, unless given)")
    parser.add_argument("--from", dest="from_run", metavar="RUN_DIR",
                        help="load the model weights of this run's latest checkpoint")
    parser.add_argument("-o", "--output", default="whatif.csv", help="CSV file")
    parser.add_argument("--png", default=None, help="heat-map (default: the CSV's name, .png)")
    parser.add_argument("--plan", default=None, metavar="FILE",
                        help="also write the choice as a plan file (.json or .toml)")
    add_limit_flags(parser)


def measure_config(cfg, source: dict[str, str]):
    """The settings a what-if measures at, and which of them are its own defaults: unless given,
    the batch is :data:`WHATIF_BATCH` (a what-if measures, it does not train). The model keeps
    training's position table (``max_seq_len``), so ``--from`` a run at the defaults still fits."""
    small = {k: v for k, v in WHATIF_BATCH.items() if source.get(k) == "default"}
    if small:
        keep = {"max_seq_len": cfg.seq_len} if "seq_len" in small and cfg.max_seq_len is None else {}
        cfg = dataclasses.replace(cfg, **small, **keep)
    return cfg, small


def run(args: argparse.Namespace) -> int:
    from mixprec.plan.whatif import what_if
    from mixprec.cli.plan import limit_args, model_and_batches, model_settings, say_untrained, settings_file
    from torch import nn
    from mixprec.policy.overrides import write_plan
    from mixprec.train.config import load_config, parse_overrides
    if args.batches < 1:
        raise ConfigError("--batches must be >= 1")
    if not 0 < args.tolerance < 100:
        raise ConfigError("--tolerance is in percent of the loss, between 0 and 100")
    limits = limit_args(args)
    cfg, small = measure_config(*load_config(settings_file(args.config, args.from_run),
                                             parse_overrides(args.settings)))
    model, batches, strategy = model_and_batches(cfg, args.from_run, args.batches)
    tokens = len(batches) * cfg.batch_size * cfg.seq_len
    print(f"[mixprec] what-if for the Linear layers of model {cfg.model} on {len(batches)} batches "
          f"of {cfg.batch_size}x{cfg.seq_len} tokens ({tokens} tokens"
          f"{'; the what-if default ' + ', '.join(f'{k}={v}' for k, v in small.items()) if small else ''}) "
          f"(weights: {args.from_run or 'initialisation, seed ' + str(cfg.seed)})", file=sys.stderr)
    say_untrained(args.from_run)
    report = what_if(model, batches, formats=args.formats.split(","), gpu=args.gpu,
                     tolerance=args.tolerance / 100, seed=cfg.seed, **limits,
                     progress=lambda s: print(f"[mixprec] measured {s}", file=sys.stderr))
    print(report.table())
    out = report.write_csv(args.output)
    png = report.heatmap(args.png or Path(args.output).with_suffix(".png"))
    print(f"[mixprec] csv: {out}  heat-map: {png}", file=sys.stderr)
    if args.plan:
        made_for = model_settings(cfg)
        plan = write_plan(args.plan, "32-true", report.overrides, made_for=made_for,
                          linears=[n for n, m in model.named_modules() if isinstance(m, nn.Linear)])
        print(f"[mixprec] plan: {plan} (train with it: mixprec train {made_for} --precision plan:{plan})",
              file=sys.stderr)
    strategy.teardown()
    return 0
