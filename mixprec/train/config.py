"""Configuration of a training run: defaults < TOML file < ``key=value`` on the command line.

:class:`FitConfig` holds what the training loop needs (any model); :class:`TrainConfig` adds what
``mixprec train`` needs to build the model and the data. Both are frozen keyword-only
dataclasses; every field is documented where it is declared, and ``validate()`` rejects
impossible values with a one-line message.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixprec.errors import ConfigError, closest
from mixprec.monitor.guard import GuardConfig
from mixprec.optim.moments import MOMENTS
from mixprec.policy.overrides import normalize_overrides
from mixprec.precision import get_policy
from mixprec.precision.recipe import Recipe

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["FitConfig", "TrainConfig", "load_config", "parse_overrides", "config_to_toml"]


_SCALER_OPTIONS = {"init_scale": "init_scale", "growth_interval": "growth_interval",
                   "hysteresis": "hysteresis", "min_scale": "min_scale",
                   "on_stuck_scale": "on_min_scale"}
"""FitConfig field -> the ``Precision(**scaler_options)`` / ``GradScaler`` argument it sets."""
_SCALER_CONFIG = {"init_scale": "init_scale", "growth_interval": "scale_window",
                  "hysteresis": "hysteresis", "min_scale": "min_scale", "on_min_scale": "on_min_scale"}
"""``GradScaler`` argument -> the field of its ``LossScaleConfig`` that holds it."""


@dataclass(frozen=True, kw_only=True)
class FitConfig:
    """Knobs of the training loop (:class:`mixprec.Trainer`)."""

    precision: str = "auto"
    """Policy name (see ``mixprec.get_policy``); ``auto`` = best safe mode for this hardware;
    ``plan:PATH`` = a plan file written by ``mixprec plan``."""
    precision_overrides: tuple[tuple[str, str], ...] = ()
    """Per-layer compute formats, first match wins: ``{"head": "bf16", "blocks.0.*": "fp32"}`` in
    Python, an ``[overrides]`` table in TOML, ``precision_overrides=head=bf16,blocks.0.*=fp32`` on
    the command line (see ``mixprec/policy/overrides.py``)."""
    micro_options: str = ""
    """Changes to the micro-format recipes (``mxfp8``, ``mxfp4``, ``nvfp4``), e.g.
    ``micro_options=hadamard_wgrad=false,stochastic_grad=false,bf16_last=0`` (fields of
    :class:`mixprec.formats.MicroConfig`; see docs/micro-formats.md)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (skipped steps count). None: run ``epochs``."""
    epochs: int = 1
    """Passes over the training data when ``max_steps`` is None."""
    lr: float = 1e-3
    """Peak learning rate (after warm-up)."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at ``lr * min_lr_ratio``."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW)."""
    beta1: float = 0.9
    """AdamW's first-moment decay (beta1)."""
    beta2: float = 0.95
    """AdamW's second-moment decay (beta2; torch's AdamW defaults to 0.999). 0.95 is a
    language-model default (GPT-style pre-training); it applies only to the AdamW ``fit()`` builds."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step; the loss is divided by this number."""
    clip_grad_norm: float | None = 1.0
    """Clip the global gradient norm (on unscaled gradients); None or 0 disables."""
    log_interval: int = 10
    """Write a metrics row every N steps."""
    eval_interval: int = 100
    """Evaluate on the validation data every N steps (0: only at the end)."""
    eval_batches: int = 20
    """Validation batches per evaluation."""
    ckpt_interval: int = 100
    """Save a checkpoint every N steps (0: only at the end)."""
    keep_last: int = 3
    """Keep this many most recent checkpoints; ``0`` (or ``keep_last=all`` on the command line)
    keeps every one."""
    run_dir: str | None = None
    """Run folder; default ``runs/<date>-<time>-<precision>`` (made unique: ``-2``, ``-3``, ...)."""
    overwrite: bool = False
    """Start a new run in a ``run_dir`` that already holds one, deleting the old run's files. Off:
    such a folder is refused (resume it instead)."""
    max_skipped_fraction: float = 0.1
    """End the run (non-zero exit) when more than this fraction of the steps after warm-up were
    skipped for non-finite gradients, or 20 in a row were (checked at each log interval); 1
    disables both checks."""
    seed: int = 0
    """Seed of every random generator (model init, data order, dropout)."""
    init_scale: float = 2.0**16
    """Initial loss scale (used only when the policy needs loss scaling)."""
    growth_interval: int = 2000
    """Clean steps before the loss scale doubles."""
    hysteresis: int = 1
    """Overflows tolerated before the scale backs off."""
    min_scale: float = 1.0
    """Floor of the loss scale."""
    on_stuck_scale: str = "warn"
    """When the scale sits at its floor or too many recent steps were skipped: ``warn`` or ``raise``."""
    trace_nonfinite: bool = True
    """On a skipped step, replay the batch with hooks to find the layer that made the inf/NaN."""
    monitor_every: int = 0
    """Per-layer range statistics every N steps (0: off)."""
    replan_every: int = 0
    """Re-plan per-layer formats every N steps (0: off): an FP8 layer whose inputs stop fitting FP8
    moves to the mode's non-FP8 format, and back after ``replan_window`` healthy samples
    (``mixprec.monitor.LayerReplanner``)."""
    replan_window: int = 3
    """Healthy samples before a promoted layer returns to its planned FP8 format."""
    guard: bool = False
    """Guarded training (``mixprec.monitor.guard``): a Linear traced as the origin of inf/NaN on
    consecutive skipped steps, or whose sampled output SQNR falls below ``guard_min_sqnr``, moves
    one format safer (FP8 -> BF16 -> FP32), undoing the steps since its last passing sample when a
    snapshot allows; a loss spike restores the last good snapshot (and promotes the layer that
    stands out). The run ends (exit 3) only when no safer format is left."""
    guard_every: int = 50
    """Steps between the guard's SQNR samples, the first at step 1 (0: none)."""
    guard_min_sqnr: float | None = None
    """SQNR limit (dB) of the guard's samples (none: each format's own, FP8 20 dB, NVFP4 8 dB).
    Those are ``mixprec.formats.limits``, the planner's and the what-if's too (docs/per-layer.md).
    A layer whose sampled output SQNR against FP32 is below it is promoted; a number given applies
    to every format, as given."""
    guard_max_flush: float | None = None
    """Flushed-input limit (share) of the guard's samples (none: each format's own, FP8 0.01, NVFP4 0.42).
    Those are ``mixprec.formats.limits``. A layer whose format flushes more of its
    sampled inputs is promoted; a number given applies to every format, as given."""
    guard_spike_sigma: float = 6.0
    """A loss this many standard deviations above the guard's window mean is a spike (0: off)."""
    guard_window: int = 50
    """Taken steps in the guard's spike window, and between its snapshots."""
    audit: bool = True
    """Run the pre-flight precision audit at the start of training."""
    progress: bool = True
    """Show a progress bar (rank 0 only)."""
    overlap_optimizer: bool = False
    """Issue each taken optimizer step per module on a side CUDA stream so it overlaps the next
    forward (bit-identical; in order on CPU). See mixprec/optim/overlap.py."""
    split_masters: bool = True
    """Store the FP32 master of each BF16 parameter as the parameter plus a 16-bit remainder and
    keep no FP32 master gradients (bit-identical updates, 2 bytes per parameter instead of 8;
    mixprec/optim/split.py). false: full FP32 masters. No effect where there are no masters."""
    moments: str = "fp32"
    """Storage of Adam's two moments: ``fp32`` (8 bytes per parameter), ``bf16`` (4, FP32 math,
    stochastic rounding), ``int8`` (2.004: block-wise, stochastic rounding), ``fp8`` (2.03: E4M3
    with per-block range expansion) or ``fp8-e5m2`` (2.03: E5M2 likewise); mixprec/optim/moments.py.
    8-bit formats cover matrices; vectors (biases, norms) keep FP32 moments. Needs mixprec's AdamW
    (not with a mode without masters); under FSDP2 the moments shard and reshard with the
    parameters."""
    fp8_activations: bool = False
    """Keep the tensors Linear layers save for backward (their inputs) in FP8 E4M3 with per-block
    scales, widened in backward: ~1 byte per value instead of 2 (BF16) or 4; the forward is
    unchanged, weight gradients see E4M3 rounding of the inputs. mixprec/nn/fp8_activations.py."""
    loss_chunk: int = 0
    """Compute the loss ``loss_chunk`` tokens at a time (0: off): the head and the FP32
    cross-entropy run one slice at a time and are recomputed in backward, so the ``(tokens,
    vocab)`` FP32 logits exist for one slice only (gpt-ref's default step: -160 MiB), at one more
    head matmul per token. mixprec's Transformer only (refused for other models and with a
    ``loss_fn``); docs/lean.md."""
    profile: int = 0
    """Profile this many steps (after 2 warm-up steps) with torch.profiler: ``profile.txt`` (top
    operators by category) and ``trace.json`` (Chrome trace) in the run folder. 0: off."""
    compile: bool = False
    """``torch.compile`` the model (not the loop); the first steps pay the compile time."""
    export_hf: bool = False
    """Hugging Face models: also write a ``save_pretrained`` folder into each checkpoint
    (``checkpoints/step-N/hf``). The run's final weights always go to ``RUN_DIR/hf``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision_overrides", normalize_overrides(self.precision_overrides))

    def scaler_options(self) -> dict[str, Any]:
        """The loss-scaler settings as :class:`mixprec.Precision` / ``GradScaler`` arguments."""
        return {fit: getattr(self, name) for name, fit in _SCALER_OPTIONS.items()}

    def recipe(self, precision: Any = None, *, device: Any = None, optimizer: Any = None) -> Recipe:
        """The run's :class:`~mixprec.precision.recipe.Recipe`: ``precision`` (default: the
        ``precision`` field) with this config's overrides, micro options, loss-scaler settings,
        master layout, moments and activation storage; ``optimizer`` one that already stores the
        parameters in 16 bits decides ``auto``."""
        return Recipe.build(self.precision if precision is None else precision, device=device,
                            overrides=self.precision_overrides,
                            micro_options=self.micro_options or None, optimizer=optimizer,
                            split_masters=self.split_masters, moments=self.moments,
                            fp8_activations=self.fp8_activations, **self.scaler_options())

    def guard_config(self):
        """The :class:`mixprec.monitor.guard.GuardConfig` of the ``guard_*`` fields."""
        return GuardConfig(every=self.guard_every, min_sqnr_db=self.guard_min_sqnr,
                           max_flush=self.guard_max_flush,
                           spike_sigma=self.guard_spike_sigma, window=self.guard_window)

    def validate(self) -> None:
        positive = ("epochs", "lr", "grad_accum_steps", "log_interval", "eval_batches", "replan_window",
                    "init_scale", "growth_interval", "hysteresis")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("eval_interval", "ckpt_interval", "keep_last", "warmup_steps", "monitor_every",
                     "weight_decay", "profile", "replan_every", "loss_chunk"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps <= 0:
            raise ConfigError(f"max_steps must be > 0, got {self.max_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.moments not in MOMENTS:
            raise ConfigError(f"moments must be one of {', '.join(MOMENTS)}, got '{self.moments}'")
        if self.on_stuck_scale not in ("warn", "raise"):
            raise ConfigError(f"on_stuck_scale must be 'warn' or 'raise', got '{self.on_stuck_scale}'")
        if not self.min_scale > 0:
            raise ConfigError(f"min_scale must be > 0, got {self.min_scale:g}")
        if not self.init_scale >= self.min_scale:
            # the user may have set only init_scale: name it, and the min_scale it is checked against
            default = " (the default)" if self.min_scale == type(self).min_scale else ""
            raise ConfigError(f"init_scale={self.init_scale:g} is below min_scale={self.min_scale:g}{default}, "
                              f"the floor the loss scale never goes under; lower min_scale too (e.g. "
                              f"init_scale={self.init_scale:g} min_scale={self.init_scale:g}) or raise "
                              f"init_scale to >= {self.min_scale:g}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0.0 < self.max_skipped_fraction <= 1.0:
            raise ConfigError(f"max_skipped_fraction must be in (0, 1], got {self.max_skipped_fraction}")
        if self.guard and self.replan_every:
            raise ConfigError("guard=true and replan_every both move layers between formats; use "
                              "one of them (the guard keeps a promotion, the re-planner moves back)")
        if self.guard and not self.trace_nonfinite:
            raise ConfigError("guard=true finds the layer that made an inf/NaN by tracing the "
                              "skipped step; set trace_nonfinite=true")
        if self.guard:
            self.guard_config().validate()
        if self.clip_grad_norm is not None and self.clip_grad_norm < 0:
            raise ConfigError(f"clip_grad_norm must be >= 0 (0 or none disables), got {self.clip_grad_norm}")
        get_policy(self.precision)  # raises with the valid names


@dataclass(frozen=True, kw_only=True)
class TrainConfig(FitConfig):
    """Everything ``mixprec train`` needs: the loop, plus the model and the data.

    The defaults are the README's main job: the ``small`` model on the built-in corpus for 300
    steps, a few minutes on two CPU cores.
    """

    max_steps: int | None = 300
    """Stop after this many optimizer steps (None: run ``epochs`` over the data)."""
    lr: float = 2e-3
    """Peak learning rate (after warm-up)."""
    warmup_steps: int = 30
    """Linear warm-up steps."""
    eval_interval: int = 50
    """Evaluate on the validation data every N steps (0: only at the end)."""

    model: str = "small"
    """Model preset (``tiny``, ``small``, ``gpt-ref``; the fields below override it), or
    ``hf:PATH``: a Hugging Face causal LM built from a local ``config.json`` (or a folder with one;
    random init from ``seed``, never downloaded; see docs/hf.md)."""
    vocab_size: int | None = None
    """Token ids the model's embedding covers; None: what the data declares or its largest id + 1."""
    init_from: str | None = None
    """With ``model=hf:PATH``: start from the weights of this local ``save_pretrained`` folder
    (safetensors) instead of a random init."""
    num_layers: int | None = None
    """Transformer blocks; None = the model preset's."""
    d_model: int | None = None
    """Model width; None = the model preset's."""
    num_heads: int | None = None
    """Attention heads; None = the model preset's."""
    num_experts: int | None = None
    """MoE experts per MLP (0: dense)."""
    norm: str | None = None
    """``layernorm`` or ``rmsnorm``."""
    dropout: float | None = None
    """Dropout probability; None = the model preset's."""
    gradient_checkpointing: bool = False
    """Recompute block activations in backward to save memory."""
    data: str | None = None
    """Token file, .npy, text file or folder; None = the built-in corpus (Python's stdlib source)."""
    val_data: str | None = None
    """Validation data; None = a held-out split of ``data`` (``val_fraction``)."""
    val_fraction: float = 0.05
    """Share of ``data`` held out for validation when ``val_data`` is not given."""
    seq_len: int = 128
    """Tokens per sample."""
    max_seq_len: int | None = None
    """Longest sequence the model takes (the size of its position table); None: ``seq_len``. A
    resumed run keeps its model's and may train at any ``seq_len`` up to it."""
    batch_size: int = 16
    """Samples per micro-batch per rank."""
    num_workers: int = 0
    """Data loader worker processes."""
    strategy: str = "auto"
    """``auto`` (DDP under torchrun, else single device), ``single``, ``ddp``, ``fsdp``."""
    grad_compression: str = "none"
    """DDP gradient compression: ``none``, ``fp16``, ``bf16``, ``topk``."""
    topk_ratio: float = 0.3
    """Fraction of gradient values sent with ``grad_compression=topk``."""
    resume: str = "off"
    """``auto``: if ``run_dir`` holds a complete checkpoint, continue from the newest one, else
    start fresh (what a job restarted by ``torchrun --max-restarts`` needs); needs ``run_dir``.
    ``off``: always start fresh (``--resume RUN_DIR`` still resumes explicitly)."""

    def validate(self) -> None:
        super().validate()
        for name in ("seq_len", "batch_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_seq_len is not None and self.max_seq_len < self.seq_len:
            raise ConfigError(f"seq_len={self.seq_len} is longer than max_seq_len={self.max_seq_len} "
                              f"(the model's position table); use seq_len<={self.max_seq_len}")
        if self.num_workers < 0:
            raise ConfigError(f"num_workers must be >= 0, got {self.num_workers}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.init_from is not None and not self.model.startswith("hf:"):
            raise ConfigError(f"init_from needs a Hugging Face model: add model=hf:{self.init_from} "
                              "(the architecture of the folder's config.json)")
        if not 0.0 < self.topk_ratio <= 1.0:
            raise ConfigError(f"topk_ratio must be in (0, 1], got {self.topk_ratio}")
        for name, choices in (("strategy", ("auto", "single", "ddp", "fsdp")),
                              ("grad_compression", ("none", "fp16", "bf16", "topk")),
                              ("resume", ("off", "auto"))):
            if getattr(self, name) not in choices:
                raise ConfigError(f"{name} must be one of {', '.join(choices)}, got "
                                  f"'{getattr(self, name)}'{closest(getattr(self, name), choices)}")
        if self.resume == "auto" and self.run_dir is None:
            raise ConfigError("resume=auto needs an explicit run_dir=PATH (the folder a restarted "
                              "job looks in for its checkpoints); a fresh default folder never has one")

    def fit_config(self) -> FitConfig:
        names = {f.name for f in dataclasses.fields(FitConfig)}
        return FitConfig(**{k: v for k, v in dataclasses.asdict(self).items() if k in names})


# --- reading and merging ----------------------------------------------------------------------

def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


_WORDS: dict[str, dict[str, Any]] = {"keep_last": {"all": 0}}
"""Words a setting accepts besides its type's values (``keep_last=all`` keeps every checkpoint)."""

ALIASES: dict[str, str] = {
    "learning_rate": "lr", "lr_rate": "lr", "max_length": "seq_len", "max_seq_len": "seq_len",
    "seq_length": "seq_len", "sequence_length": "seq_len", "context_length": "seq_len",
    "block_size": "seq_len", "batch": "batch_size", "micro_batch": "batch_size",
    "micro_batch_size": "batch_size", "steps": "max_steps", "num_steps": "max_steps",
    "train_steps": "max_steps", "total_steps": "max_steps", "warmup": "warmup_steps",
    "output_dir": "run_dir", "out_dir": "run_dir", "checkpoint_dir": "run_dir",
    "save_total_limit": "keep_last", "save_steps": "ckpt_interval", "eval_steps": "eval_interval",
    "logging_steps": "log_interval", "gradient_accumulation_steps": "grad_accum_steps",
    "max_grad_norm": "clip_grad_norm", "grad_clip": "clip_grad_norm", "mixed_precision": "precision",
    "dtype": "precision", "n_layer": "num_layers", "n_layers": "num_layers", "n_embd": "d_model",
    "hidden_size": "d_model", "n_head": "num_heads", "dataset": "data", "train_data": "data",
}
"""Names other tools use for a setting (Hugging Face, nanoGPT, Lightning): the "did you mean"."""


def setting_suggestion(key: str) -> str:
    """``" (did you mean 'lr'?)"`` for an unknown setting name, or ``""``."""
    names = _field_types(TrainConfig)
    if key in ALIASES and ALIASES[key] in names:
        return f" (did you mean '{ALIASES[key]}'?)"
    return closest(key, names)


def _coerce(name: str, value: Any, hint: Any, *, from_text: bool) -> Any:
    """Convert ``value`` to the field's type, with a one-line error naming the field."""
    if from_text and isinstance(value, str) and value.strip().lower() in _WORDS.get(name, {}):
        return _WORDS[name][value.strip().lower()]
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if from_text and isinstance(value, str):
        text = value.strip()
        if optional and text.lower() in ("none", "null", ""):
            return None
        try:
            if base is bool:
                if text.lower() in ("true", "1", "yes", "on"):
                    return True
                if text.lower() in ("false", "0", "no", "off"):
                    return False
                raise ValueError
            if base is int:
                return int(text)
            if base is float:
                return float(text)
        except ValueError:
            raise ConfigError(f"{name} expects {_type_name(base)}, got '{value}'") from None
        return text
    if value is None and optional:
        return None
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base is bool and not isinstance(value, bool) or base is int and (
            not isinstance(value, int) or isinstance(value, bool)) or base is float and not isinstance(
            value, float) or base is str and not isinstance(value, str):
        raise ConfigError(f"{name} expects {_type_name(base)}, got {value!r}")
    return value


def _type_name(t: Any) -> str:
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(t, str(t))


def _flatten(table: dict[str, Any], prefix: str = "",
             tables: dict[str, str] | None = None) -> dict[str, Any]:
    """TOML tables are for grouping only: ``[optim] lr = 1e-3`` is the same as ``lr = 1e-3``.
    ``tables`` (when given) learns the table each key came from (``lr`` -> ``optim``)."""
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, prefix=f"{prefix}{key}.", tables=tables))
        else:
            flat[key] = value
            if tables is not None and prefix:
                tables[key] = prefix.rstrip(".")
    return flat


def parse_overrides(items: list[str]) -> dict[str, str]:
    """``["lr=3e-4", "max_steps=100"]`` -> ``{"lr": "3e-4", "max_steps": "100"}``. A setting given
    twice with different values is refused (the last would win silently); the same value twice is
    kept once."""
    out: dict[str, str] = {}
    given: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"cannot read '{item}': settings on the command line are key=value, "
                              "e.g. lr=3e-4")
        name = key.strip().replace("-", "_")
        if name in out and out[name].strip() != value.strip():
            raise ConfigError(f"{name} given twice: {given[name]} and {item}; pass one")
        out[name], given[name] = value, item
    return out


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None, *,
                cls: type[FitConfig] = TrainConfig) -> tuple[FitConfig, dict[str, str]]:
    """Merge defaults < TOML file < overrides; return the config and where each value came from."""
    types = _field_types(cls)
    values: dict[str, Any] = {}
    source: dict[str, str] = {name: "default" for name in types}
    layers: list[tuple[str, dict[str, Any], bool]] = []
    tables: dict[str, str] = {}
    """A file's key -> the TOML table it stood in (``[optim]``), to name a misspelt table."""
    if path is not None:
        p = Path(path)
        try:
            with p.open("rb") as f:
                table = tomllib.load(f)
            # [overrides] maps layer patterns to formats: a table of data, not a group of settings.
            layer_table = table.pop("overrides", None)
            # [recipe]: the record of every precision choice a run made (Recipe.to_toml); the
            # settings above rebuild the same one, so it is checked, not read as settings.
            recorded = table.pop("recipe", None)
            if isinstance(recorded, dict):
                Recipe.from_dict(recorded)
            flat = _flatten(table, tables=tables)
            if layer_table is not None:
                flat["precision_overrides"] = layer_table
            layers.append((f"file {p.name}", flat, False))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {p}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
    if overrides:
        layers.append(("command line", dict(overrides), True))
    for origin, table, from_text in layers:
        for key, value in table.items():
            if key not in types:
                group = tables.get(key) if not from_text else None
                if group is not None and closest(group, ["overrides"]):
                    # [overides]: a misspelt layer table, not a setting named after a layer
                    raise ConfigError(f"unknown table [{group}] ({origin}) (did you mean "
                                      "[overrides]?); [overrides] maps layer patterns to formats, "
                                      "e.g. \"head\" = \"bf16\"")
                hint = setting_suggestion(key) if cls is TrainConfig else closest(key, types)
                raise ConfigError(f"unknown setting '{key}' ({origin}){hint}; valid: "
                                  f"{', '.join(sorted(types))}")
            if key == "precision_overrides":
                values[key] = normalize_overrides(value)
            else:
                values[key] = _coerce(key, value, types[key], from_text=from_text)
            source[key] = origin
    config = cls(**values)
    config.validate()
    return config, source


def given_settings(config: FitConfig | None, overrides: dict[str, Any]) -> set[str]:
    """The FitConfig fields a caller set: passed as arguments, or differing from the defaults in
    the ``config`` it passed."""
    given = set(overrides)
    if config is not None:
        default = FitConfig()
        given |= {f.name for f in dataclasses.fields(FitConfig)
                  if getattr(config, f.name) != getattr(default, f.name)}
    return given


def refuse_changes_to_ready_precision(precision: Any, cfg: FitConfig, given: set[str]) -> None:
    """A ready :class:`mixprec.Precision` keeps its own settings: a fit() setting that would change
    them is refused in one line (the same value is fine)."""
    mode = precision.name
    if "precision" in given and (get_policy(cfg.precision, device=precision.device).spec()
                                 != precision.policy.spec()):
        raise ConfigError(f"precision={cfg.precision!r} with a ready Precision({mode!r}): it keeps "
                          "its own mode; pass one of them")
    if "precision_overrides" in given and tuple(cfg.precision_overrides) != tuple(precision.policy.overrides):
        raise ConfigError("precision_overrides with a ready Precision: pass them to it, "
                          f"mixprec.Precision({mode!r}, overrides=...)")
    recipe = precision.recipe
    for name in ("split_masters", "moments", "fp8_activations"):
        value, own = getattr(cfg, name), getattr(recipe, name)
        if name in given and value != own:
            raise ConfigError(f"{name}={value!r} would change the ready Precision({mode!r}), whose "
                              f"{name} is {own!r}; pass it to the Precision: "
                              f"mixprec.Precision({mode!r}, {name}={value!r})")
    have = precision.scaler.config
    for name, option in _SCALER_OPTIONS.items():
        value, own = getattr(cfg, name), getattr(have, _SCALER_CONFIG[option])
        if name in given and value != own:
            raise ConfigError(f"{name}={value!r} would change the ready Precision({mode!r}), whose "
                              f"{option} is {own!r}; pass it to the Precision: "
                              f"mixprec.Precision({mode!r}, {option}={value!r})")


def refuse_two_modes(mixed_precision: Any, precision: str, device: Any) -> None:
    """``fit(mixed_precision=A, precision=B)``: fine when A and B name the same mode."""
    if get_policy(mixed_precision, device=device).spec() != get_policy(precision, device=device).spec():
        raise ConfigError(f"mixed_precision={mixed_precision!r} and precision={precision!r} "
                          "disagree; pass one of them")


def config_to_toml(config: FitConfig, more: str = "") -> str:
    """The resolved config as TOML (None values are written as comments); ``more``: further
    ``key = value`` lines, written before the ``[overrides]`` table (keys after a table belong
    to it)."""
    lines = []
    table: list[str] = []
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        if f.name == "precision_overrides":
            # TOML tables come after the plain keys; their order is kept (first match wins).
            table = ["", "[overrides]", *(f"{json.dumps(pat)} = {json.dumps(fmt)}" for pat, fmt in v)]
            continue
        if v is None:
            lines.append(f"# {f.name} = (none)")
        elif isinstance(v, bool):
            lines.append(f"{f.name} = {'true' if v else 'false'}")
        elif isinstance(v, (int, float)):
            lines.append(f"{f.name} = {v!r}")
        else:
            lines.append(f'{f.name} = "{v}"')
    if more:
        lines.append(more.rstrip("\n"))
    return "\n".join(lines + (table if len(table) > 2 else [])) + "\n"
