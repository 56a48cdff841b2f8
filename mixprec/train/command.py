"""``mixprec train``: train a Transformer on the built-in corpus (or your data) from a config.

Settings come from, in increasing precedence: defaults, the resumed run's ``config.toml``,
``--config FILE``, ``--precision``, and ``key=value`` arguments. The resolved settings and where
each came from are printed at the start.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from mixprec.errors import ConfigError
from mixprec.train.config import TrainConfig, load_config, parse_overrides

__all__ = ["configure", "run", "build_run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("settings", nargs="*", metavar="KEY=VALUE",
                        help="override any setting, e.g. max_steps=200 lr=3e-4 (see --list)")
    parser.add_argument("--config", metavar="FILE", help="TOML file with settings")
    parser.add_argument("--precision", metavar="NAME",
                        help="precision policy: auto, 32-true, bf16-mixed, 16-mixed, bf16-true, "
                             "fp8-blockwise, ... or p=f32,c=bf16,o=f32")
    parser.add_argument("--resume", metavar="RUN_DIR",
                        help="continue the run in RUN_DIR from its latest checkpoint")
    parser.add_argument("--list", action="store_true", help="list every setting with its default")


def _resolve(args: argparse.Namespace) -> tuple[TrainConfig, dict[str, str]]:
    overrides = parse_overrides(args.settings)
    if args.precision:
        overrides["precision"] = args.precision
    base: dict[str, object] = {}
    if args.resume:
        run_dir = Path(args.resume)
        saved = run_dir / "config.toml"
        if not saved.is_file():
            raise ConfigError(f"cannot resume: {saved} not found; pass the folder of an earlier "
                              "`mixprec train` run")
        base_cfg, _ = load_config(saved)
        base = {k: v for k, v in dataclasses.asdict(base_cfg).items()}
        base["run_dir"] = str(run_dir)
    cfg, source = load_config(args.config, overrides)
    if base:
        # The resumed run's settings replace the defaults; the file and the command line still win.
        merged = {**base, **{k: getattr(cfg, k) for k, s in source.items() if s != "default"}}
        cfg = TrainConfig(**merged)
        cfg.validate()
        source = {k: (s if s != "default" else "resumed run") for k, s in source.items()}
    return cfg, source


def build_run(cfg: TrainConfig):
    """Data, model and strategy for a config (also used by ``mixprec audit``)."""
    from mixprec.data import DistributedDataLoader, TokenDataset, builtin_corpus
    from mixprec.models import Transformer
    from mixprec.strategies import get_strategy

    kwargs = {}
    if cfg.grad_compression != "none" and cfg.strategy in ("single", "fsdp"):
        raise ConfigError(f"grad_compression={cfg.grad_compression} needs strategy=ddp (or auto): "
                          f"it is a DDP communication hook, and strategy={cfg.strategy} has none")
    if cfg.grad_compression != "none":
        kwargs = {"grad_compression": cfg.grad_compression, "topk_ratio": cfg.topk_ratio}
    strategy = get_strategy(cfg.strategy, **kwargs)
    if cfg.data is None:
        corpus = builtin_corpus()
        train_ds = TokenDataset(corpus.train_path, cfg.seq_len)
        val_ds = TokenDataset(corpus.val_path, cfg.seq_len)
    else:
        train_ds = TokenDataset(cfg.data, cfg.seq_len)
        if cfg.val_data is not None:
            val_ds = TokenDataset(cfg.val_data, cfg.seq_len)
        else:
            train_ds, val_ds = train_ds.split(cfg.val_fraction)
    overrides = {k: getattr(cfg, k) for k in _PRESET_FIELDS if getattr(cfg, k) is not None}
    torch.manual_seed(cfg.seed)
    if cfg.model.startswith("hf:"):
        model = _build_hf_model(cfg, train_ds.vocab_size)
    else:
        model = Transformer.from_preset(cfg.model, vocab_size=train_ds.vocab_size,
                                        max_seq_len=cfg.seq_len,
                                        gradient_checkpointing=cfg.gradient_checkpointing, **overrides)
    train_loader = DistributedDataLoader(train_ds, cfg.batch_size, num_workers=cfg.num_workers,
                                         shuffle=True, seed=cfg.seed, rank=strategy.rank,
                                         world_size=strategy.world_size)
    val_loader = DistributedDataLoader(val_ds, cfg.batch_size, shuffle=False, seed=cfg.seed,
                                       drop_last=False,
                                       rank=strategy.rank, world_size=strategy.world_size)
    return model, train_loader, val_loader, strategy


_PRESET_FIELDS = ("num_layers", "d_model", "num_heads", "num_experts", "norm", "dropout")


def _build_hf_model(cfg: TrainConfig, vocab_size: int):
    """``model=hf:PATH``: a Hugging Face causal LM from a local config.json (see train/hf.py)."""
    from mixprec.train.hf import build_hf_model

    shaped = [k for k in _PRESET_FIELDS if getattr(cfg, k) is not None]
    if shaped:
        raise ConfigError(f"{shaped[0]}= shapes mixprec's own presets; with model={cfg.model} edit "
                          "its config.json instead")
    return build_hf_model(cfg.model, vocab_size=vocab_size, seq_len=cfg.seq_len,
                          init_from=cfg.init_from,
                          gradient_checkpointing=cfg.gradient_checkpointing)


def run(args: argparse.Namespace) -> int:
    if args.list:
        for f in dataclasses.fields(TrainConfig):
            print(f"{f.name} = {f.default!r}")
        return 0
    cfg, source = _resolve(args)
    from mixprec.train.trainer import Trainer

    model, train_loader, val_loader, strategy = build_run(cfg)
    if strategy.is_main:
        print("[mixprec] settings (non-default):", file=sys.stderr)
        defaults = TrainConfig()
        for k, s in source.items():
            if s != "default" and getattr(cfg, k) != getattr(defaults, k):
                print(f"[mixprec]   {k} = {getattr(cfg, k)!r}  ({s})", file=sys.stderr)
    trainer = Trainer(model, config=cfg, strategy=strategy)  # the full config lands in config.toml
    result = trainer.fit(train_loader, val_loader, resume=bool(args.resume))
    if strategy.is_main:
        val = f"{result.final_val_loss:.4f}" if result.final_val_loss is not None else "n/a"
        print(f"[mixprec] done: {result.steps} steps ({result.skipped_steps} skipped), "
              f"final validation loss {val}, precision {result.policy}", file=sys.stderr)
        print(f"[mixprec] run folder: {result.run_dir}", file=sys.stderr)
        print(f"[mixprec] resume:  mixprec train --resume {result.run_dir} max_steps=<more>",
              file=sys.stderr)
        print(f"[mixprec] report:  mixprec report {result.run_dir}", file=sys.stderr)
    strategy.teardown()
    return 0
