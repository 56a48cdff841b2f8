"""``mixprec train``: train a Transformer on the built-in corpus (or your data) from a config.

Settings come from, in increasing precedence: defaults, the resumed run's ``config.toml``,
``--config FILE``, ``--precision``, and ``key=value`` arguments. The resolved settings and where
each came from are printed at the start.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import NoReturn

import torch
from torch.overrides import TorchFunctionMode

from mixprec import hints
from mixprec.errors import ConfigError, DataError, RunInterrupted, excerpt
from mixprec.strategies.env import read_env
from mixprec.train.config import TrainConfig, load_config, parse_overrides
from mixprec.train.signals import exit_code

__all__ = ["configure", "run", "build_run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("settings", nargs="*", metavar="KEY=VALUE",
                        help="override any setting, e.g. max_steps=200 lr=3e-4 (see --list)")
    parser.add_argument("--config", metavar="FILE", help="TOML file with settings")
    parser.add_argument("--precision", metavar="NAME",
                        help="precision policy: auto, 32-true, bf16-mixed, 16-mixed, bf16-true, "
                             "fp8-blockwise, ... or p=f32,c=bf16,o=f32")
    parser.add_argument("--resume", metavar="PATH",
                        help="continue a run: its folder (newest checkpoint) or one of its "
                             "checkpoints/step-N folders")
    parser.add_argument("--list", action="store_true", help="list every setting with its default")


def _resolve(args: argparse.Namespace) -> tuple[TrainConfig, dict[str, str], Path | None]:
    """The config, where each value came from, and the run folder to resume (None: fresh)."""
    overrides = parse_overrides(args.settings)
    if args.precision:
        given = overrides.get("precision")
        if given is not None and given.strip() != args.precision.strip() \
                and not _same_mode(given, args.precision):
            raise ConfigError(f"--precision {args.precision} and precision={given} disagree; "
                              "pass one of them")
        overrides["precision"] = args.precision
    cfg, source = load_config(args.config, overrides)
    resume_dir = resume_from = None
    if args.resume:
        resume_dir, resume_from = _run_folder_of(Path(args.resume))
    if resume_dir is None and cfg.resume == "auto":
        from mixprec.runs.checkpoint import list_checkpoints
        # Every rank looks at the same (shared) folder, so every rank takes the same decision.
        # A folder with a run but no complete checkpoint (stopped before its first save) is
        # resumed too: the trainer starts it over from step 0 and says so.
        if list_checkpoints(Path(cfg.run_dir) / "checkpoints") or (Path(cfg.run_dir) / "config.toml").is_file():
            resume_dir = resume_from = Path(cfg.run_dir)
    if resume_dir is None:
        _refuse_unused(cfg, source)
        return _with_max_seq_len(cfg, None), source, None
    saved = resume_dir / "config.toml"
    if not saved.is_file():
        raise ConfigError(f"cannot resume: {saved} not found; pass the folder of an earlier "
                          "`mixprec train` run")
    base_cfg, _ = load_config(saved)
    if base_cfg.model.startswith("fit: "):
        raise ConfigError(f"cannot resume {resume_dir} with mixprec train: fit() trained it on "
                          f"{base_cfg.model[5:]}, which the command line cannot build; continue it "
                          f"from Python with fit(..., run_dir={str(resume_dir)!r}, resume=True)")
    base: dict[str, object] = dict(dataclasses.asdict(base_cfg))
    base["run_dir"] = str(resume_dir)
    # The resumed run's settings replace the defaults; the file and the command line still win.
    merged = {**base, **{k: getattr(cfg, k) for k, s in source.items() if s != "default"}}
    cfg = TrainConfig(**merged)
    cfg.validate()
    _refuse_unused(cfg, source)
    source = {k: (s if s != "default" else "resumed run") for k, s in source.items()}
    if source.get("model") == "resumed run" and cfg.model.startswith("hf:"):
        from mixprec.models.hf import resume_spec
        spec, why = resume_spec(cfg.model, resume_dir)    # its config.json moved: the run's copy
        if why is not None:
            cfg, source["model"] = dataclasses.replace(cfg, model=spec), f"resumed run; {why}"
    return _with_max_seq_len(cfg, base_cfg), source, resume_from


def _refuse_unused(cfg: TrainConfig, source: dict[str, str]) -> None:
    """A validation setting that this run would not use is refused, not ignored."""
    if source.get("val_fraction", "default") != "default" and (cfg.val_data is not None or cfg.data is None):
        why = ("val_data= names the validation data" if cfg.val_data is not None else
               "the built-in corpus has its own validation split")
        raise ConfigError(f"val_fraction={cfg.val_fraction:g} splits data= into training and validation, "
                          f"but {why}; drop val_fraction")


def _with_max_seq_len(cfg: TrainConfig, base: TrainConfig | None) -> TrainConfig:
    """The model's position table length, resolved: given, the resumed run's (``max_seq_len``, or
    its ``seq_len`` for a run saved before the setting existed), else ``seq_len``. A resumed run
    may train at a shorter ``seq_len``, never a longer one."""
    length = cfg.max_seq_len
    if length is None and base is not None:
        length = base.max_seq_len or base.seq_len
    length = length or cfg.seq_len
    if cfg.seq_len > length:
        raise ConfigError(f"seq_len={cfg.seq_len} is longer than the model's max_seq_len={length} (its "
                          f"position table{', from the resumed run' if base is not None else ''}); use "
                          f"seq_len<={length}" + (", or start a new run for longer sequences"
                                                 if base is not None else ""))
    return dataclasses.replace(cfg, max_seq_len=length)


def _same_mode(a: str, b: str) -> bool:
    """Two names of one mode (``bf16`` and ``bf16-mixed``); False when either is unknown, or
    ``auto`` (which mode it is depends on the machine)."""
    from mixprec.precision import get_policy
    if "auto" in (a.strip().lower(), b.strip().lower()):
        return False
    try:
        return get_policy(a, device="cpu").spec() == get_policy(b, device="cpu").spec()
    except (ValueError, OSError):
        return False


def _run_folder_of(path: Path) -> tuple[Path, Path]:
    """``(run folder, what to resume from)`` for a run folder, its checkpoints/ folder or one
    checkpoint folder inside it."""
    if not path.exists():
        raise ConfigError(f"cannot resume: {path} does not exist; pass the folder of an earlier "
                          "`mixprec train` run or one of its checkpoints/step-N folders")
    for run_dir in (path, path.parent, path.parent.parent):
        if (run_dir / "config.toml").is_file():
            return run_dir, path
    raise ConfigError(f"cannot resume: no config.toml in {path} or the two folders above it; pass "
                      "the folder of an earlier `mixprec train` run or one of its checkpoints/step-N "
                      "folders")


_STRAY_ID_RATIO = 8   # a largest id this many times the distinct-id count is not a vocabulary


def _check_vocabulary(ds, say: bool) -> None:
    """Refuse data whose vocabulary was inferred from one stray id (a 10^6 in a byte-level .npy
    would build a 64M-parameter embedding table)."""
    if ds.vocab_inferred:
        distinct = ds.count_distinct_ids()
        if ds.vocab_size > 1024 and ds.vocab_size > _STRAY_ID_RATIO * distinct:
            raise DataError(f"{ds.root}: the largest token id is {ds.vocab_size - 1} but the data holds "
                            f"only {distinct} distinct ids, so a vocabulary of {ds.vocab_size} is "
                            "probably one stray id; fix the data, or set vocab_size=N if it is right")
    if say:
        how = "inferred from the data's largest id" if ds.vocab_inferred else "declared or set"
        print(f"[mixprec] vocabulary: {ds.vocab_size} ids ({how})", file=sys.stderr)


def _warn_binary(ds, say: bool) -> None:
    """One line per text file that looks binary (random bytes, an executable named .txt)."""
    if say:
        for path, share in ds.binary_text_files():
            print(f"[mixprec] warning: data looks binary: {share:.0%} non-text bytes in the first 64 KiB "
                  f"of {path}; it trains as bytes anyway (check the file)", file=sys.stderr)


def _available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _step_memory(model, cfg: TrainConfig, on_cpu: bool):
    """The memory estimator's answer (mixprec.estimate.memory) for one training step of ``model``
    at the config's batch_size x seq_len: states by precision, activations with the attention the
    model runs (fused SDPA: no seq_len^2 score matrix is kept)."""
    from mixprec.estimate.memory import ModelShape, estimate_memory
    shape = ModelShape.from_config(model.config)
    from mixprec.precision import Precision
    kwargs = dict(batch=cfg.batch_size, seq=cfg.seq_len, checkpointing=cfg.gradient_checkpointing,
                  loss_chunk=cfg.loss_chunk, device="cpu" if on_cpu else None)
    try:   # the run's recipe: its mode, master layout, moments and activation storage
        return shape, estimate_memory(shape, Precision(cfg.recipe()), **kwargs)
    except (ConfigError, ValueError):     # a plan file or a mode the estimator does not model
        return shape, estimate_memory(shape, "32-true", split_masters=cfg.split_masters,
                                      moments_dtype=cfg.moments, fp8_activations=cfg.fp8_activations,
                                      **kwargs)


class _NoDrawsOnMeta(TorchFunctionMode):
    """Random initialisation of meta tensors does nothing (they hold no values); left to torch,
    ``normal_`` on meta loads its Python meta kernels (sympy included), ~2 s of CPU per start."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        if getattr(func, "__name__", "") in ("normal_", "trunc_normal_") and \
                isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


def _check_fits_in_memory(build, vocab_size: int, cfg: TrainConfig | None = None, *,
                          say: bool = False) -> None:
    """Before allocating, ask the memory estimator what one step of the model (``build()`` makes
    it) needs at ``batch_size x seq_len`` and refuse it when that exceeds the memory free here. With
    ``say``, one warning line when the sequence is long: the position table grows with seq_len and
    attention's FLOPs grow with seq_len^2 (the numbers and the fix)."""
    cfg = cfg or TrainConfig()
    with torch.device("meta"), _NoDrawsOnMeta():   # shapes only: nothing is allocated
        model = build()
    n = model.num_parameters()
    on_cpu = not torch.cuda.is_available()   # on a GPU the states live in its own memory
    shape, mem = _step_memory(model, cfg, on_cpu)
    free = _available_memory_bytes()
    gib = 2**30
    if free is not None and on_cpu and mem.peak > free:
        raise ConfigError(f"the model has {n / 1e6:.1f}M parameters (vocab_size {vocab_size}) and a step of "
                          f"batch_size={cfg.batch_size} x seq_len={cfg.seq_len} needs ~{mem.peak / gib:.1f} GiB "
                          f"({mem.states / gib:.1f} GiB weights, gradients and optimizer state, "
                          f"{mem.activations / gib:.1f} GiB activations) but {free / gib:.1f} GiB are free; lower "
                          "seq_len or batch_size, set gradient_checkpointing=true, or pick a smaller model or "
                          "vocabulary (`mixprec memory` shows where the bytes go)")
    if not say:
        return
    from mixprec.models.config import MODEL_PRESETS
    preset = MODEL_PRESETS.get(cfg.model)
    positions = preset.max_seq_len if preset is not None else cfg.seq_len
    per_token = model.flops_per_token(cfg.seq_len)
    attention = 6.0 * model.config.num_layers * model.config.d_model * cfg.seq_len / per_token
    import dataclasses as dc
    base = dc.replace(shape, max_seq_len=positions).num_parameters() if cfg.seq_len > positions else n
    # A position table a little longer than the preset's (tiny's 64 rows at the default seq_len
    # of 128) is worth no warning; one that grows the model by more than a tenth is.
    if n <= 1.1 * base and attention < 0.5:
        return
    step_flops = per_token * cfg.batch_size * cfg.seq_len * cfg.grad_accum_steps
    grown = ""
    if n > 1.1 * base:
        grown = (f"seq_len={cfg.seq_len} is longer than model {cfg.model}'s {positions} positions: its "
                 f"position table grows to {cfg.seq_len} rows, so the model has {n / 1e6:.2f}M parameters "
                 f"({base / 1e6:.2f}M at {positions}); ")
    print(f"[mixprec] warning: {grown}a step is {step_flops / 1e12:.2f} TFLOP, {attention:.0%} of it "
          f"attention (which grows with seq_len^2), and needs ~{mem.peak / gib:.2f} GiB (fused attention: "
          f"no seq_len^2 score matrix is kept); lower seq_len, or pick a model made for long "
          f"sequences", file=sys.stderr)


def build_run(cfg: TrainConfig):
    """Data, model and strategy for a config (also used by ``mixprec audit``)."""
    from mixprec.data import DistributedDataLoader, TokenDataset, builtin_corpus
    from mixprec.models import Transformer
    from mixprec.strategies import get_strategy

    kwargs = {}
    if cfg.grad_compression != "none":   # get_strategy refuses it for a strategy without DDP hooks
        kwargs = {"grad_compression": cfg.grad_compression, "topk_ratio": cfg.topk_ratio}
    strategy = get_strategy(cfg.strategy, **kwargs)
    vocab = cfg.vocab_size
    if cfg.val_data is not None and not Path(cfg.val_data).exists():
        raise DataError(f"val_data path {cfg.val_data} does not exist; check the path (or omit "
                        "val_data= to validate on a held-out part of the training data)")
    if cfg.data is None:
        corpus = builtin_corpus()
        train_ds = TokenDataset(corpus.train_path, cfg.seq_len, vocab_size=vocab)
        # val_data= alone: your validation data against the built-in training corpus.
        val_ds = TokenDataset(cfg.val_data or corpus.val_path, cfg.seq_len,
                              vocab_size=vocab if cfg.val_data is None else train_ds.vocab_size)
    else:
        train_ds = TokenDataset(cfg.data, cfg.seq_len, vocab_size=vocab)
        _check_vocabulary(train_ds, strategy.is_main)
        _warn_binary(train_ds, strategy.is_main)
        if cfg.val_data is not None:
            val_ds = TokenDataset(cfg.val_data, cfg.seq_len, vocab_size=train_ds.vocab_size)
            _warn_binary(val_ds, strategy.is_main)
        else:
            train_ds, val_ds = train_ds.split(cfg.val_fraction)
    overrides = {k: getattr(cfg, k) for k in _PRESET_FIELDS if getattr(cfg, k) is not None}

    def build_transformer():
        return Transformer.from_preset(cfg.model, vocab_size=train_ds.vocab_size, max_seq_len=cfg.max_seq_len or cfg.seq_len,
                                       gradient_checkpointing=cfg.gradient_checkpointing, **overrides)
    if cfg.model.startswith("hf:"):
        torch.manual_seed(cfg.seed)
        model = _build_hf_model(cfg, train_ds.vocab_size)
    else:
        _check_fits_in_memory(build_transformer, train_ds.vocab_size, cfg, say=strategy.is_main)
        torch.manual_seed(cfg.seed)
        model = build_transformer()
    train_loader = DistributedDataLoader(train_ds, cfg.batch_size, num_workers=cfg.num_workers,
                                         shuffle=True, seed=cfg.seed, rank=strategy.rank,
                                         world_size=strategy.world_size)
    val_loader = DistributedDataLoader(val_ds, cfg.batch_size, shuffle=False, seed=cfg.seed,
                                       drop_last=False,
                                       rank=strategy.rank, world_size=strategy.world_size)
    return model, train_loader, val_loader, strategy


_PRESET_FIELDS = ("num_layers", "d_model", "num_heads", "num_experts", "norm", "dropout")


def _build_hf_model(cfg: TrainConfig, vocab_size: int):
    """``model=hf:PATH``: a Hugging Face causal LM from a local config.json (see models/hf.py)."""
    from mixprec.models.hf import build_hf_model

    shaped = [k for k in _PRESET_FIELDS if getattr(cfg, k) is not None]
    if shaped:
        raise ConfigError(f"{shaped[0]}= shapes mixprec's own presets; with model={cfg.model} edit "
                          "its config.json instead")
    return build_hf_model(cfg.model, vocab_size=vocab_size, seq_len=cfg.seq_len,
                          init_from=cfg.init_from,
                          gradient_checkpointing=cfg.gradient_checkpointing)


def settings_lines(cfg: TrainConfig, source: dict[str, str]) -> list[str]:
    """The settings that differ from the defaults and where each came from, under one header;
    nothing at all (no bare header) when every setting is the default."""
    defaults = TrainConfig()
    changed = [f"  {k} = {getattr(cfg, k)!r}  ({s})" for k, s in source.items()
               if s != "default" and getattr(cfg, k) != getattr(defaults, k)]
    return ["settings (non-default):", *changed] if changed else []


def _field_docs() -> dict[str, str]:
    """Each setting's description: the first sentence of its docstring in train/config.py."""
    import ast
    import inspect
    import re
    from mixprec.train import config as module
    docs: dict[str, str] = {}
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.ClassDef):
            body = node.body
            for field, doc in zip(body, body[1:]):
                if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) and \
                        isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and \
                        isinstance(doc.value.value, str):
                    text = " ".join(doc.value.value.split()).replace("``", "")
                    first = re.split(r"(?<=[a-z0-9)])\. (?=[A-Z`(])", text)[0].rstrip(".")
                    docs[field.target.id] = excerpt(first, 90)
    return docs


def _default_text(value: object) -> str:
    if value is None or value == ():
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return '""'
    return f"{value:g}" if isinstance(value, float) else str(value)


def settings_table() -> str:
    """``mixprec train --list``: every setting, its default and what it does, as aligned columns.
    The loop's settings are shared with ``fit()`` and ``Trainer``, some with other defaults there
    (``mixprec train`` runs 300 steps on its corpus; ``fit()`` runs epochs): a ``fit()`` column
    shows those, blank where the two agree."""
    from mixprec.train.config import FitConfig
    docs = _field_docs()
    fit_defaults = {f.name: _default_text(f.default) for f in dataclasses.fields(FitConfig)}
    rows = [(f.name, _default_text(f.default), docs.get(f.name, "")) for f in dataclasses.fields(TrainConfig)]
    fit_col = {n: fit_defaults[n] for n, d, _ in rows if n in fit_defaults and fit_defaults[n] != d}
    width = (max(len("setting"), *(len(r[0]) for r in rows)), max(len("default"), *(len(r[1]) for r in rows)),
             max(len("fit()"), *map(len, fit_col.values())))
    lines = ["Settings: key=value on the command line, or in a TOML file (--config FILE).", ""]
    lines += ["training loop (also fit() and Trainer, whose defaults are in the fit() column where they differ)",
              f"  {'setting':<{width[0]}}  {'default':<{width[1]}}  {'fit()':<{width[2]}}  description"]
    lines += [f"  {n:<{width[0]}}  {d:<{width[1]}}  {fit_col.get(n, ''):<{width[2]}}  {doc}".rstrip()
              for n, d, doc in rows if n in fit_defaults]
    lines += ["", "model, data and launch (mixprec train)",
              f"  {'setting':<{width[0]}}  {'default':<{width[1]}}  description"]
    lines += [f"  {n:<{width[0]}}  {d:<{width[1]}}  {doc}".rstrip() for n, d, doc in rows if n not in fit_defaults]
    return "\n".join(lines).rstrip()


def run(args: argparse.Namespace) -> int:
    if args.list:
        print(settings_table())
        return 0
    hints.from_command_line()          # every hint from here on is a shell command for this launch
    cfg, source, resume_from = _resolve(args)
    from mixprec.train.finished import finished_run
    if (finished := finished_run(cfg.run_dir, resume_from, cfg.max_steps)) is not None:
        # Nothing to do is not an error (exit 0, docs/CONTRACTS.md); nothing is built or written.
        if read_env().rank == 0:
            print(f"[mixprec] {finished.line()}", file=sys.stderr)
        return 0
    from mixprec.train.trainer import Trainer

    model, train_loader, val_loader, strategy = build_run(cfg)
    if strategy.is_main:
        for line in settings_lines(cfg, source):
            print(f"[mixprec] {line}", file=sys.stderr)
        if cfg.resume == "auto" and not args.resume:
            from mixprec.runs.checkpoint import list_checkpoints
            print("[mixprec] resume=auto: " + (f"continuing from the newest checkpoint in {resume_from}"
                  if resume_from and list_checkpoints(resume_from) else
                  f"no complete checkpoint in {cfg.run_dir}, starting fresh"), file=sys.stderr)
    trainer = Trainer(model, config=cfg, strategy=strategy)  # the full config lands in config.toml
    try:
        result = trainer.fit(train_loader, val_loader, resume=resume_from)
        # The DDP/FSDP wrappers hold the process group: drop them before teardown destroys it
        # (Strategy.teardown: a group still alive at interpreter exit can abort or hang the process).
        del trainer, model, train_loader, val_loader
        if strategy.is_main and not result.nothing_to_train:    # (an epochs= run: fit() said so)
            val = f"{result.final_val_loss:.4f}" if result.final_val_loss is not None else "n/a"
            print(f"[mixprec] done: {result.steps} steps ({result.skipped_steps} skipped), "
                  f"final validation loss {val}, precision {result.policy}", file=sys.stderr)
            print(f"[mixprec] run folder: {result.run_dir}", file=sys.stderr)
            more = 2 * result.steps
            # The command ends its line: a note after it ("  (train on ...)") broke the paste.
            print(f"[mixprec] to train on to step {more} (the LR schedule is re-stretched to the "
                  "new end, docs/checkpoints.md):", file=sys.stderr)
            print(f"[mixprec] resume:  {hints.resume(result.run_dir, max_steps=more)}", file=sys.stderr)
            print(f"[mixprec] report:  {hints.report(result.run_dir)}", file=sys.stderr)
        strategy.teardown()   # barrier (bounded by the timeout), then destroy the group
    except BaseException as exc:
        if strategy.is_distributed:
            _end_failed_rank(strategy.rank, exc, debug=getattr(args, "debug", False))
        raise
    return 0


def _end_failed_rank(rank: int, exc: BaseException, *, debug: bool) -> NoReturn:
    """A rank of a distributed run failed: say so in one line naming the rank, then exit at once.

    The process group is *not* destroyed and the interpreter does not finalize it: the peers may
    be dead or stuck in a collective, and tearing down a broken gloo/NCCL group can block. The
    peers notice at their next collective (a closed connection at once, a hung rank after at most
    the process-group timeout, ``MIXPREC_DIST_TIMEOUT``), and torchrun stops the rest of the job
    as soon as this process exits non-zero.
    """
    from mixprec.errors import MixprecError
    user_error = isinstance(exc, (MixprecError, OSError))
    if isinstance(exc, KeyboardInterrupt):
        signum = getattr(exc, "signum", signal.SIGINT)      # Aborted carries its signal
        print(f"mixprec: interrupted ({signal.Signals(signum).name}, rank {rank})", file=sys.stderr)
        code = exit_code(signum)
    elif isinstance(exc, RunInterrupted):   # stopped after saving: said once, by rank 0
        if rank == 0:
            print(f"mixprec: {exc}", file=sys.stderr)
            if "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("MIXPREC_LAUNCHER") != "mixprec.launch":
                print(f"mixprec: every rank saved and exits {exc.exit_code}; torchrun's own report "
                      "may follow (a SignalException or ChildFailedError traceback, exit status 1): "
                      "it is about this same stop, and the run resumes with the command above; "
                      "`python -m mixprec.launch` (same arguments) ends with this status instead "
                      "(docs/distributed.md)", file=sys.stderr)
        code = exc.exit_code
    else:
        if debug or not user_error:
            traceback.print_exception(exc)
        text = str(exc).strip() or type(exc).__name__
        if not user_error:
            text = f"{type(exc).__name__}: {excerpt(exc, 300)}"
        prefix = "" if text.startswith(f"rank {rank}:") else f"rank {rank}: "
        print(f"mixprec: error: {prefix}{text}", file=sys.stderr)
        code = getattr(exc, "exit_code", 2) if user_error else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
