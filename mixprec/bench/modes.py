"""``mixprec bench train``: the same training step under each precision mode, side by side.

Every contender (a mixprec precision mode, or with ``--peers`` the plain ``torch.autocast`` loop,
Accelerate and Lightning Fabric when installed) is built once on the identical model (same preset,
same seed) and the identical batch. Timing then *alternates* the contenders inside each repeat,
so a noisy, shared machine slows all of them alike, and reports the median and the spread
(min-max, quartiles) of the per-step time. The matmul peak of each compute dtype (the MFU
denominator) is measured inside the same rounds, not read from a cache, so it sees the same load. The mixprec modes run :meth:`mixprec.train.Trainer.train_step`
itself, so the benchmark measures the step users run, not a re-implementation of it.

Peak memory is measured separately, one fresh process per contender, because a process's peak
RSS never goes down and the contenders of one process share it: on CPU it is the growth of
the peak RSS over the RSS of the freshly imported process, on CUDA ``max_memory_allocated``.
"""
from __future__ import annotations

import csv
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mixprec.errors import ConfigError, excerpt

__all__ = ["bench_figure", "TrainBenchConfig", "Contender", "build_contender", "bench_train", "PEERS",
           "bench_device", "format_table", "write_csv", "write_png", "profile_contender"]

PEERS: tuple[str, ...] = ("torch-autocast-bf16", "accelerate-bf16", "fabric-bf16-mixed", "fabric-bf16-true",
                          "torchao-adamw8bit", "torchao-adamwfp8", "bnb-adamw8bit", "torchao-float8")
"""Peer loops added by ``--peers``; all but the first are skipped when their package is absent.
``torchao-adamw8bit``, ``torchao-adamwfp8`` and ``bnb-adamw8bit`` are the ``torch.autocast`` BF16
loop (FP32 parameters) with torchao's 8-bit / FP8 AdamW (``torchao.optim``, which
``torch.compile``s its step) or bitsandbytes' 8-bit AdamW; ``torchao-float8`` is that loop with
the model's Linears converted by ``torchao.float8.convert_to_float8_training`` (tensorwise FP8,
the peer of mixprec's ``fp8-tensorwise``; skipped off a GPU with FP8 tensor cores)."""

VARIANTS: tuple[str, ...] = ("overlap", "compile", "fullmasters", "bf16moments", "int8moments", "fp8moments",
                             "fp8e5m2moments", "fp8acts", "ckpt", "chunkedloss")
"""Suffixes of a mode name: ``bf16-mixed+overlap`` (overlap_optimizer=true), ``32-true+compile``
(``torch.compile`` of the model), ``bf16-true+fullmasters`` (split_masters=false: full FP32
masters and master gradients, mixprec before split masters), ``bf16-true+bf16moments``
(moments=bf16; ``+int8moments``, ``+fp8moments``, ``+fp8e5m2moments`` likewise), ``+fp8acts``
(fp8_activations=true), ``+ckpt`` (activation checkpointing of every block), ``+chunkedloss``
(``loss_chunk=LOSS_CHUNK`` tokens), or several
(``bf16-mixed+overlap+compile``)."""


LOSS_CHUNK = 256
"""Tokens per slice of the ``+chunkedloss`` variant's loss."""


def split_variant(name: str) -> tuple[str, frozenset[str]]:
    """``"bf16-mixed+overlap"`` -> ``("bf16-mixed", {"overlap"})``; unknown suffixes raise."""
    base, *extras = [part.strip() for part in name.split("+")]
    for e in extras:
        if e not in VARIANTS:
            from mixprec.errors import closest
            raise ConfigError(f"unknown variant '+{e}' in '{name}'{closest(e, VARIANTS)}; valid: "
                              + ", ".join(f"+{v}" for v in VARIANTS))
    return base, frozenset(extras)


@dataclass(frozen=True, kw_only=True)
class TrainBenchConfig:
    """What ``bench train`` measures. Validated at construction."""

    model: str = "small"
    """Model preset (``tiny``, ``small``, ``gpt-ref``, ``gpt2-124m``/``355m``/``774m``), optionally
    with fields changed: ``gpt2-355m:num_layers=12`` (:func:`mixprec.bench.model_spec.model_config`)."""
    modes: tuple[str, ...] = ("32-true", "bf16-mixed")
    """mixprec precision modes, and/or peer names from :data:`PEERS`."""
    batch: int = 8
    """Samples per step."""
    seq: int = 128
    """Tokens per sample (the model's ``max_seq_len`` grows to fit)."""
    repeats: int = 5
    """Rounds; in each, every contender is timed once (alternation)."""
    steps: int = 2
    """Timed steps per contender per round (their mean is one sample)."""
    warmup: int = 2
    """Untimed steps per contender before the first round."""
    clip: float | None = None
    """Gradient clipping in the mixprec step (None: off, as in the peer loops)."""
    device: str | None = None
    """``cpu``, ``cuda``...; default: CUDA when available."""
    lr: float = 1e-4
    """Learning rate of every contender's AdamW."""
    threads: int | None = None
    """CPU threads (``torch.set_num_threads``); None keeps torch's default. On an oversubscribed
    machine, 1 thread avoids OpenMP barriers waiting for descheduled threads."""

    def __post_init__(self) -> None:
        for name in ("batch", "seq", "repeats", "steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0, got {self.warmup}")
        if not self.modes:
            raise ConfigError("--modes is empty; name at least one mode, e.g. 32-true,bf16-mixed")
        from mixprec.bench.model_spec import model_config
        from mixprec.precision import get_policy
        model_config(self.model)  # raises with the valid presets and fields
        for m in self.modes:
            if m not in PEERS:
                get_policy(split_variant(m)[0])  # raises with the valid names


@dataclass
class Contender:
    """One way of running the step: ``step()`` runs one optimizer step on the fixed batch."""

    name: str
    compute_dtype: torch.dtype
    step: Callable[[], None]
    times: list[float] = field(default_factory=list)
    first_step_s: float | None = None
    """Wall time of the first (warm-up) step: includes the compile time of ``+compile``."""
    warmup_s: float = 0.0
    warmup_steps: int = 0
    """All warm-up steps and their time: ``compile_s`` is this minus as many median steps."""


def bench_device(cfg: TrainBenchConfig) -> torch.device:
    return torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _model_and_batch(cfg: TrainBenchConfig, device: torch.device):
    from mixprec.bench.model_spec import model_config
    from mixprec.models import Transformer
    mcfg = model_config(cfg.model)
    if cfg.seq > mcfg.max_seq_len:
        mcfg = mcfg.replace(max_seq_len=cfg.seq)
    torch.manual_seed(0)                               # identical weights for every contender
    # Built on the device: a 355M model initialised on the host costs seconds per contender.
    with torch.device(device):
        model = Transformer.from_config(mcfg)
    g = torch.Generator().manual_seed(1)               # identical batch for every contender
    x = torch.randint(0, mcfg.vocab_size, (cfg.batch, cfg.seq), generator=g)
    y = torch.randint(0, mcfg.vocab_size, (cfg.batch, cfg.seq), generator=g)
    return model, x.to(device), y.to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mixprec(name: str, cfg: TrainBenchConfig, device: torch.device) -> Contender:
    from mixprec.train.config import FitConfig
    from mixprec.train.trainer import Trainer
    mode, variants = split_variant(name)
    model, x, y = _model_and_batch(cfg, device)
    model.gradient_checkpointing = "ckpt" in variants       # recompute each block in backward
    fit = FitConfig(precision=mode, clip_grad_norm=cfg.clip, lr=cfg.lr, warmup_steps=0,
                    log_interval=10**9, audit=False, progress=False, trace_nonfinite=False,
                    overlap_optimizer="overlap" in variants, compile="compile" in variants,
                    split_masters="fullmasters" not in variants,
                    moments=_moments_of(variants), fp8_activations="fp8acts" in variants,
                    loss_chunk=LOSS_CHUNK if "chunkedloss" in variants else 0)
    trainer = Trainer(model, config=fit, strategy="single")
    trainer.prepare(total_steps=10**6)
    trainer.model.train()
    batch = [(x, y)]
    return Contender(name, trainer.precision.recipe.compute_dtype, lambda: trainer.train_step(batch))


def _moments_of(variants: frozenset[str]) -> str:
    names = {"bf16": "bf16", "int8": "int8", "fp8": "fp8", "fp8e5m2": "fp8-e5m2"}
    return next((m for key, m in names.items() if f"{key}moments" in variants), "fp32")


def _peer(name: str, cfg: TrainBenchConfig, device: torch.device) -> Contender | None:
    """A peer loop on the identical model, or None when its package is not installed."""
    model, x, y = _model_and_batch(cfg, device)
    model.to(device)
    if name == "torchao-float8" and not _float8_converted(model, device):
        return None
    opt = _peer_optimizer(name, model, cfg.lr)
    if opt is None:
        return None
    if name == "torch-autocast-bf16" or name.startswith(("torchao-", "bnb-")):
        def step() -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return Contender(name, torch.bfloat16, step)
    if name == "accelerate-bf16":
        try:
            from accelerate import Accelerator
        except ImportError:
            return None
        acc = Accelerator(mixed_precision="bf16", cpu=device.type == "cpu")
        amodel, aopt = acc.prepare(model, opt)

        def step() -> None:
            with acc.autocast():
                _, loss = amodel(x, y)
            acc.backward(loss)
            aopt.step()
            aopt.zero_grad(set_to_none=True)
        return Contender(name, torch.bfloat16, step)
    if name.startswith("fabric-"):
        try:
            from lightning.fabric import Fabric
        except ImportError:
            return None
        fab = Fabric(accelerator=device.type, devices=1, precision=name.removeprefix("fabric-"))
        fmodel, fopt = fab.setup(model, opt)

        def step() -> None:
            _, loss = fmodel(x, y)
            fab.backward(loss)
            fopt.step()
            fopt.zero_grad(set_to_none=True)
        return Contender(name, torch.bfloat16, step)
    raise ConfigError(f"unknown peer '{name}'; valid: {', '.join(PEERS)}")


def _float8_converted(model: torch.nn.Module, device: torch.device) -> bool:
    """Swap ``model``'s 16-aligned Linears for torchao's Float8Linear (before the optimizer is
    built); False when torchao is absent or ``device`` has no FP8 tensor cores."""
    from mixprec.policy.hardware import cuda_supports_fp8
    if device.type != "cuda" or not cuda_supports_fp8():
        return False
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        return False
    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear)
                               and m.in_features % 16 == 0 and m.out_features % 16 == 0)
    return True


def skip_reason(name: str, device: torch.device) -> str:
    """Why :func:`build_contender` gave None for peer ``name`` on ``device`` (one clause)."""
    from mixprec.policy.hardware import cuda_supports_fp8
    if name == "torchao-float8" and (device.type != "cuda" or not cuda_supports_fp8()):
        return f"torchao's float8 training needs a GPU with FP8 tensor cores, not {device.type}"
    return "its package is not installed"


def _peer_optimizer(name: str, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer | None:
    """The peer's AdamW (torch's unless the peer is an 8-bit optimizer), None if not installed."""
    try:
        if name == "torchao-adamw8bit":
            from torchao.optim import AdamW8bit
            return AdamW8bit(model.parameters(), lr=lr)
        if name == "torchao-adamwfp8":
            from torchao.optim import AdamWFp8
            return AdamWFp8(model.parameters(), lr=lr)
        if name == "bnb-adamw8bit":
            import bitsandbytes as bnb
            return bnb.optim.AdamW8bit(model.parameters(), lr=lr)
    except ImportError:
        return None
    return torch.optim.AdamW(model.parameters(), lr=lr)


def build_contender(name: str, cfg: TrainBenchConfig) -> Contender | None:
    """The contender ``name`` (a precision mode or a peer) ready to step; None if not installed."""
    device = bench_device(cfg)
    return _peer(name, cfg, device) if name in PEERS else _mixprec(name, cfg, device)


def _is_compile_error(e: BaseException) -> bool:
    """Raised by torch.compile (dynamo or inductor), not by the model itself."""
    return any(type(x).__module__.startswith(("torch._dynamo", "torch._inductor"))
               for x in (e, e.__cause__) if x is not None)


def _time_steps(c: Contender, n: int, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        c.step()
    _sync(device)                       # time finished work, not queued kernels
    return (time.perf_counter() - t0) / n


def _flops_per_token(cfg: TrainBenchConfig) -> float:
    from mixprec.bench.model_spec import model_config
    from mixprec.models import Transformer
    mcfg = model_config(cfg.model)
    with torch.device("meta"):
        model = Transformer.from_config(mcfg.replace(max_seq_len=max(cfg.seq, mcfg.max_seq_len)))
    return model.flops_per_token(seq_len=cfg.seq)


def measure_peak_memory(name: str, cfg: TrainBenchConfig, steps: int = 3, timeout: float = 900.0) -> float | None:
    """Peak bytes of ``steps`` training steps of ``name``, in a fresh process (None if unavailable).

    CPU: peak RSS (``VmHWM``, reset after imports) minus the RSS after imports, so the ~300 MB of
    torch itself is not counted. CUDA: ``torch.cuda.max_memory_allocated``.

    On a CPU the child runs with glibc's mmap threshold fixed at 128 KiB (``MALLOC_MMAP_THRESHOLD_``,
    unless the caller's environment sets it): by default glibc raises the threshold after the
    first large tensor is freed and serves later tensors from a heap that never shrinks, so the
    RSS peak would count memory already freed (up to +100 MiB on ``gpt-ref``, and enough to put
    every ``bf16-true`` row above ``32-true``; docs/performance.md). With it fixed, freed tensors
    return to the OS and the peak is the tensors' peak, which is what the estimator models.
    """
    spec = json.dumps({"name": name, "cfg": {k: (list(v) if isinstance(v, tuple) else v)
                                             for k, v in vars(cfg).items()}, "steps": steps})
    code = "import sys; from mixprec.bench.modes import _memory_probe; _memory_probe(sys.argv[1])"
    env = dict(os.environ, OMP_NUM_THREADS=str(cfg.threads or torch.get_num_threads()))
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    out = subprocess.run([sys.executable, "-c", code, spec], capture_output=True, text=True,
                         timeout=timeout, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"memory probe for {name} failed: {out.stderr.strip()[-500:]}")
    value = json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]
    return None if value is None else float(value)


def _status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_rss_peak() -> int:
    """Reset the process's peak RSS (Linux ``clear_refs`` 5) and return the current RSS in bytes.

    Without the reset, the peak would include transient memory of imports (~300 MB for torch),
    and small models would measure as 0. Where the reset is unavailable, the baseline is the
    peak so far, which can only under-count.
    """
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        now = _status_kib("VmRSS")
        if now is not None:
            return now * 1024
    except OSError:
        pass
    return _rss_peak_bytes()


def _rss_peak_bytes() -> int:
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _memory_probe(spec_json: str) -> None:
    """Child side of :func:`measure_peak_memory`: prints ``{"peak_bytes": ...}``."""
    spec = json.loads(spec_json)
    kw = spec["cfg"]
    kw["modes"] = tuple(kw["modes"])
    cfg = TrainBenchConfig(**kw)
    device = bench_device(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    import mixprec.train.trainer  # noqa: F401  (imports belong to the baseline)
    # One step of the same contender on a 1 x 8-token tiny model first: lazy imports (dynamo,
    # optimizer helpers, peers' packages) and one-off allocations then belong to the baseline.
    import gc
    warm = build_contender(spec["name"], TrainBenchConfig(model="tiny", modes=cfg.modes, batch=1, seq=8,
                                                          device=cfg.device, threads=cfg.threads))
    if warm is not None:
        warm.step()
    del warm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = _reset_rss_peak()
    c = build_contender(spec["name"], cfg)
    if c is None:
        print(json.dumps({"peak_bytes": None}))
        return
    for _ in range(spec["steps"]):
        c.step()
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _rss_peak_bytes() - base
    print(json.dumps({"peak_bytes": peak}))


def bench_train(cfg: TrainBenchConfig, *, memory: bool = True,
                log: Callable[[str], None] = lambda s: None) -> list[dict]:
    """Rows of {mode, step_s_median, step_s_min, step_s_max, tokens_per_s, mfu, peak_mem_mb, ...}."""
    from mixprec.policy.dtypes import dtype_name
    from mixprec.policy.peak import peak_flops
    device = bench_device(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    contenders, skipped = [], []
    for name in cfg.modes:
        c = build_contender(name, cfg)
        if c is None:
            skipped.append(name)
            log(f"skipped {name}: {skip_reason(name, device)}")
        else:
            contenders.append(c)
    failed = []
    for c in contenders:                 # warm-up: allocator, autocast caches, lazy optimizer state
        compiles = "compile" in split_variant(c.name)[1]
        warm: list[float] = []
        # torch.compile may still (re)compile in the second or third step: warm a compiled model
        # up until a step is no slower than 1.5x the one before (at most 8 steps).
        while len(warm) < max(cfg.warmup, 1) or (compiles and len(warm) < 8 and (
                len(warm) < 3 or warm[-1] > 1.5 * warm[-2])):
            t0 = time.perf_counter()
            try:
                c.step()
            except Exception as e:       # a mode torch.compile cannot compile: report, go on
                if not compiles or not _is_compile_error(e):
                    raise
                reason = f"{type(e).__name__}: {excerpt(e, 300)}"
                log(f"skipped {c.name}: torch.compile failed ({reason}); the eager mode stays")
                failed.append(c)
                break
            _sync(device)
            warm.append(time.perf_counter() - t0)
        c.first_step_s = warm[0] if warm else None
        c.warmup_s = sum(warm)
        c.warmup_steps = len(warm)
    contenders = [c for c in contenders if c not in failed]
    dtypes = sorted({c.compute_dtype for c in contenders}, key=str)
    peaks: dict[torch.dtype, list[float]] = {dt: [] for dt in dtypes}
    for r in range(cfg.repeats):
        order = contenders if r % 2 == 0 else contenders[::-1]   # alternate, and reverse the order
        for c in order:
            c.times.append(_time_steps(c, cfg.steps, device))
        for dt in dtypes:                # the MFU denominator, under this round's load
            peaks[dt].append(peak_flops(dt, device, use_cache=False))
        log(f"round {r + 1}/{cfg.repeats}: " + ", ".join(f"{c.name} {c.times[-1] * 1e3:.0f} ms"
                                                          for c in contenders))
    tokens = cfg.batch * cfg.seq
    fpt = _flops_per_token(cfg)
    base = next((c for c in contenders if c.name == "32-true"), None)
    rows = []
    for c in contenders:
        med = statistics.median(c.times)
        q = statistics.quantiles(c.times, n=4) if len(c.times) >= 2 else [med, med, med]
        peak = statistics.median(peaks[c.compute_dtype])
        rows.append({
            "mode": c.name, "compute_dtype": dtype_name(c.compute_dtype),
            "step_ms_median": med * 1e3, "step_ms_min": min(c.times) * 1e3, "step_ms_max": max(c.times) * 1e3,
            "step_ms_q1": q[0] * 1e3, "step_ms_q3": q[2] * 1e3,
            "tokens_per_s": tokens / med,
            "speedup_vs_32_true": statistics.median(base.times) / med if base else None,
            "mfu": _mfu(fpt * tokens / med / peak, dtype_name(c.compute_dtype), device),
            "peak_gflops": peak / 1e9,
            "peak_mem_mb": None, "repeats": len(c.times),
            "first_step_s": c.first_step_s,
            "compile_s": (c.warmup_s - c.warmup_steps * med if "compile" in split_variant(c.name)[1]
                          and c.warmup_steps else None),
        })
    if memory:
        for row in rows:
            log(f"measuring peak memory of {row['mode']} in a fresh process")
            b = measure_peak_memory(row["mode"], cfg)
            row["peak_mem_mb"] = None if b is None else b / 2**20
    return rows


COLUMNS = ("mode", "compute_dtype", "step_ms_median", "step_ms_min", "step_ms_max", "step_ms_q1",
           "step_ms_q3", "tokens_per_s", "speedup_vs_32_true", "mfu", "peak_gflops", "peak_mem_mb", "repeats",
           "first_step_s", "compile_s")


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r[k] is None else (f"{r[k]:.6g}" if isinstance(r[k], float) else r[k]))
                        for k in COLUMNS})


def bench_figure(rows: list[dict], title: str):
    """The bench picture as a matplotlib Figure: tokens/s per mode (with min-max error bars when
    every mode was timed more than once), and peak memory when it was measured (no empty panel
    after ``--no-memory``)."""
    from matplotlib.figure import Figure
    names = [r["mode"] for r in rows]
    tps = [r["tokens_per_s"] for r in rows]
    repeated = all(r["repeats"] > 1 for r in rows)
    measured = [r["peak_mem_mb"] for r in rows if r["peak_mem_mb"] is not None]
    fig = Figure(figsize=(11 if measured else 6, 4), dpi=100)
    axes = list(fig.subplots(1, 2 if measured else 1, squeeze=False)[0])
    if repeated:
        # tokens per step / slowest and fastest step; clamped at 0 against rounding.
        tokens = [t * r["step_ms_median"] / 1e3 for t, r in zip(tps, rows)]
        lo = [max(0.0, t - n / (r["step_ms_max"] / 1e3)) for t, n, r in zip(tps, tokens, rows)]
        hi = [max(0.0, n / (r["step_ms_min"] / 1e3) - t) for t, n, r in zip(tps, tokens, rows)]
        axes[0].bar(names, tps, yerr=[lo, hi], capsize=4, color="tab:blue")
        axes[0].set_ylabel("tokens/s (median; bars: min-max)")
        axes[0].set_title("throughput")
    else:
        axes[0].bar(names, tps, color="tab:blue")
        axes[0].set_ylabel("tokens/s")
        axes[0].set_title("throughput (one repeat: no spread, no error bars)")
    if measured:
        axes[1].bar(names, [r["peak_mem_mb"] or 0.0 for r in rows], color="tab:orange")
        axes[1].set_ylabel("peak MiB (CPU: RSS above imports;\nCUDA: allocator peak)")
        axes[1].set_title("peak memory (one fresh process per mode)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def write_png(rows: list[dict], path: Path, title: str) -> None:
    """:func:`bench_figure` as a PNG."""
    bench_figure(rows, title).savefig(path, dpi=100)


def _mfu(value: float, fmt: str, device: torch.device) -> float | None:
    """The MFU to record: none against an emulated format's speed (BF16 on an AVX2 CPU is no
    peak: :func:`mixprec.policy.peak.no_peak_reason`), nor above 100 % of the measured peak."""
    from mixprec.policy.peak import no_peak_reason
    return None if no_peak_reason(fmt, device) or value > 1.0 else value


def format_table(rows: list[dict]) -> str:
    lines = [f"{'mode':<22} {'step ms':>9} {'min-max':>15} {'tokens/s':>10} {'vs 32-true':>10} "
             f"{'MFU':>7} {'peak GF/s':>9} {'peak MiB':>9} {'compile s':>9}"]
    for r in rows:
        sp = f"{r['speedup_vs_32_true']:.2f}x" if r["speedup_vs_32_true"] else "-"
        mem = f"{r['peak_mem_mb']:.0f}" if r["peak_mem_mb"] is not None else "-"
        comp = f"{r['compile_s']:.1f}" if r.get("compile_s") is not None else "-"
        mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] is not None else "-"   # "-": emulated format
        lines.append(f"{r['mode']:<22} {r['step_ms_median']:>9.1f} "
                     f"{r['step_ms_min']:>7.1f}-{r['step_ms_max']:<7.1f} {r['tokens_per_s']:>10.0f} "
                     f"{sp:>10} {mfu:>7} {r['peak_gflops']:>9.1f} {mem:>9} {comp:>9}")
    return "\n".join(lines)


def profile_contender(name: str, cfg: TrainBenchConfig, *, steps: int = 3, out_dir: Path,
                      warmup: int | None = None):
    """``torch.profiler`` over ``steps`` steps of ``name`` after ``warmup`` (default
    ``cfg.warmup``, at least 2) unprofiled ones; writes profile.txt and trace.json."""
    from mixprec.monitor.profile import StepProfiler
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    c = build_contender(name, cfg)
    if c is None:
        raise ConfigError(f"cannot profile {name}: its package is not installed")
    device = bench_device(cfg)
    prof = StepProfiler(steps, out_dir, device=device, warmup=max(cfg.warmup, 2) if warmup is None else warmup)
    while not prof.done:
        with prof.step():
            c.step()
    return prof.summary
