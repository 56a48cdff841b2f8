"""Measured matmul peak of this machine, per dtype: the denominator of MFU.

Vendor peak numbers say nothing about a shared 2-core VM or a CPU that emulates BF16, so mixprec
measures: a square GEMM, warmed up, synchronised, timed for a minimum duration, FLOPs = 2*n^3.
The result is cached per (device name, thread count, torch version, dtype) in the user cache
folder, so a run measures once per machine. Each entry records when it was measured, the three
runs it is the best of (their spread) and the machine's load then; an entry older than
:data:`MAX_AGE_S` (a week) is measured again (:data:`CACHE_FILE`: older versions' undated
``peak_flops.json`` is left alone and not trusted).
:func:`describe_peak` says where a run's peak comes from.

A measurement that is likely low is never cached and never an MFU denominator: one taken while
the machine's load exceeded 3/4 of its cores, or on a GPU of the datasheet table
(:mod:`mixprec.policy.datasheets`) below :data:`FAR_BELOW_DATASHEET` of its dense figure (a
GEMM timed while another job held the GPU: the first H200 run cached 155 TF for FP16, a sixth of
the datasheet's 989). It is measured once more; if that is low too, the value is returned but not
cached, and :func:`low_peak_reason` says why (``fit()`` then leaves MFU empty and says so).
"""
from __future__ import annotations

import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from mixprec.policy.datasheets import datasheet_for
from mixprec.policy.dtypes import dtype_name, parse_dtype
from mixprec.policy import hardware

__all__ = ["matmul_flops", "cuda_flops", "cuda_seconds", "time_matmul", "peak_flops", "format_peak_flops",
           "no_peak_reason", "cache_dir", "peak_record", "describe_peak", "format_peak_source", "low_peak_reason",
           "MAX_AGE_S", "CACHE_FILE", "FAR_BELOW_DATASHEET"]

log = logging.getLogger(__name__)

MAX_AGE_S = 7 * 24 * 3600
"""A cached peak older than this (seconds) is measured again: the machine, its load and its
firmware change; a week keeps a run's start cheap."""

CACHE_FILE = "peak_records.json"
"""The cache file in :func:`cache_dir`. Not the ``peak_flops.json`` of earlier versions:
its bare numbers have no date (so are never trusted here), and such a version, sharing the
cache folder, reads every entry as a number (a record would break it)."""

FAR_BELOW_DATASHEET = 0.4
"""A GPU peak measured below this share of the datasheet's dense figure is not kept. Healthy
GEMMs reach 60-85 % of it (the H200 run: 794 of 989 TF BF16); a PCIe part, matched to its SXM
row, sits near 55 %; a GEMM sharing the GPU with a training job fell to 16 %."""

_now = time.time
"""The clock cache ages are read on (tests replace it)."""

_LOW: dict[str, str] = {}
"""Cache key -> why this process's latest measurement of it was not trusted (not cached)."""


def cache_dir() -> Path:
    """``$MIXPREC_CACHE`` or ``~/.cache/mixprec``."""
    return Path(os.environ.get("MIXPREC_CACHE") or Path.home() / ".cache" / "mixprec")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _operands(n: int, count: int, device: torch.device | None = None) -> list[torch.Tensor]:
    """Random ``n x n`` FP32 matrices from a generator of their own: a measurement, taken in
    the middle of a run (the meter's re-measure), must not move the run's random stream (dropout
    masks after a resume would differ from an uninterrupted run's). On a GPU they are drawn there:
    two 8192 x 8192 matrices drawn on the host and copied cost a second or two per measurement."""
    device = torch.device("cpu") if device is None else torch.device(device)
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(n, n, generator=g, device=device) for _ in range(count)]


def cuda_seconds(run, reps: int, *, event=None) -> float:
    """Seconds ``reps`` back-to-back calls of ``run`` take on the current CUDA stream, from CUDA
    events around them (one host sync at the end). A host clock with a sync after every product
    times launches and syncs too: a 128 x 128 GEMM looked like 0.4 TFLOP/s on an H200.
    ``event``: the event class (tests pass a fake)."""
    event = event or torch.cuda.Event
    start, end = event(enable_timing=True), event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def cuda_flops(run, flops_per_call: float, min_time: float, *, event=None, max_reps: int = 1 << 16) -> float:
    """FLOP/s of ``run`` on a GPU: batches of back-to-back calls timed by CUDA events, the batch
    doubled until it lasts ``min_time`` (at least 3 calls)."""
    reps = 3
    while True:
        seconds = cuda_seconds(run, reps, event=event)
        if seconds >= min_time or reps >= max_reps:
            return flops_per_call * reps / max(seconds, 1e-9)
        # aim a little past min_time from the rate just seen; at least double
        reps = min(max_reps, max(2 * reps, int(reps * 1.2 * min_time / max(seconds, 1e-9))))


def matmul_flops(dtype: torch.dtype, device: torch.device | str = "cpu", *, n: int = 1024,
                 min_time: float = 0.2, warmup: int = 2) -> float:
    """FLOP/s of an ``n x n @ n x n`` matmul in ``dtype`` on ``device`` (timed, synchronised;
    on CUDA by events around back-to-back products, :func:`cuda_flops`)."""
    device = torch.device(device)
    drawn_on = device if device.type == "cuda" else None       # elsewhere: drawn on the host
    a, b = (x.to(device=device, dtype=dtype) for x in _operands(n, 2, drawn_on))
    for _ in range(warmup):
        a @ b
    _sync(device)
    if device.type == "cuda":
        return cuda_flops(lambda: a @ b, 2.0 * n**3, min_time)
    reps, elapsed = 0, 0.0
    start = time.perf_counter()
    while elapsed < min_time or reps < 3:
        a @ b
        reps += 1
        _sync(device)  # time finished work, not queued launches
        elapsed = time.perf_counter() - start
    return 2.0 * n**3 * reps / elapsed


def _fp8_flops(n: int, device: torch.device, min_time: float) -> float:
    """Real FP8 GEMM via ``torch._scaled_mm`` (tensorwise scales), CUDA with FP8 tensor cores."""
    a, b = (x.to(torch.float8_e4m3fn) for x in _operands(n, 2, device))
    b = b.t()                                                           # column-major operand
    one = torch.ones((), device=device)
    mm = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
    for _ in range(3):
        mm()
    torch.cuda.synchronize(device)
    return cuda_flops(mm, 2.0 * n**3, min_time)


def time_matmul(label: str, dt: torch.dtype | None, dev: torch.device, n: int,
                 min_time: float) -> float:
    """FLOP/s of one ``n x n`` product in ``label``'s dtype (``"fp8"``: a real FP8 GEMM; ``"tf32"``:
    FP32 with TF32 matmuls on). ``mixprec bench matmul`` and the planner's throughput probe use it."""
    if label == "fp8":
        return _fp8_flops(n, dev, min_time)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = label == "tf32"
    try:
        return matmul_flops(dt, dev, n=n, min_time=min_time)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def _device_key(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{platform.processor() or platform.machine()}:{_cpu_model()}:{torch.get_num_threads()}t"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _cache_key(dtype: torch.dtype, device: torch.device) -> str:
    return f"{_device_key(device)}|torch{torch.__version__}|{dtype_name(dtype)}"


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def _fresh(entry: Any) -> bool:
    """A usable cache entry: a record (not the bare number of old caches, whose age is unknown),
    measured less than :data:`MAX_AGE_S` ago (a date in the future is not trusted either)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("flops"), (int, float)):
        return False
    age = _now() - float(entry.get("measured_at", -1e18))
    return 0 <= age < MAX_AGE_S


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):    # not on every platform
        return None


def _kind(label: str) -> str:
    """The datasheet column of a measured label (FP16 runs at the BF16 rate)."""
    return "bf16" if label == "fp16" else label


def _why_low(flops: float, label: str, device: torch.device, load: float | None) -> str | None:
    """Why a measurement of ``label`` (``fp32``, ``tf32``, ``bf16``, ``fp16``, ``fp8``) on
    ``device`` is likely low, or None when nothing says so."""
    if device.type != "cuda":            # a GPU GEMM timed by CUDA events hardly feels the host's load
        cores = os.cpu_count() or 1
        if isinstance(load, (int, float)) and load > 0.75 * cores:
            return f"measured under load {load:g} on {cores} cores: likely low"
        return None
    name = torch.cuda.get_device_name(device)
    spec = datasheet_for(name)
    sheet = getattr(spec, f"{_kind(label)}_tflops", None) if spec is not None else None
    if sheet and flops < FAR_BELOW_DATASHEET * sheet * 1e12:
        return (f"{flops / 1e12:.0f} TFLOP/s is {flops / (sheet * 1e12):.0%} of the {spec.name} "
                f"datasheet's dense {label.upper()} {sheet:g} TFLOP/s (another job on the GPU?): likely low")
    return None


def low_peak_reason(fmt: str, device: torch.device | str | None = None) -> str | None:
    """Why this process's measured peak of ``fmt`` on ``device`` was not trusted (not cached, no
    MFU against it), or None."""
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    return _LOW.get(_label_key(fmt, device))


def _label_key(label: str, device: torch.device) -> str:
    """The cache key of a measured label (``tf32`` on a GPU, ``fp8`` and ``fp4`` have keys of their
    own: they are measured at every start or not at all, not cached, but may still be judged low)."""
    if label in ("fp8", "fp4") or (label == "tf32" and device.type == "cuda"):
        return f"{_device_key(device)}|torch{torch.__version__}|{label}"
    return _cache_key(torch.float32 if label == "tf32" else parse_dtype(label), device)


def _judged(flops: float, label: str, device: torch.device, measure) -> float:
    """``flops``, or a second measurement's when the first was likely low; a second low one is
    returned but recorded in :data:`_LOW` (logged at INFO once; the run says it) so callers leave
    MFU empty."""
    key = _label_key(label, device)
    why = _why_low(flops, label, device, _load())
    if why is not None:
        flops = max(flops, measure())
        why = _why_low(flops, label, device, _load())
    if why is None:
        _LOW.pop(key, None)
    else:
        if _LOW.get(key) is None:
            log.info("the measured %s peak on %s is not kept: %s", label.upper(), device, why)
        _LOW[key] = why
    return flops


def peak_record(dtype: torch.dtype, device: torch.device | str) -> dict[str, Any] | None:
    """The cache entry :func:`peak_flops` uses for ``dtype`` on ``device`` (None: none fresh):
    ``{flops, measured_at, runs, spread, load, threads, torch}``."""
    entry = _read_cache(cache_dir() / CACHE_FILE).get(_cache_key(dtype, torch.device(device)))
    return entry if _fresh(entry) else None


def describe_peak(record: dict[str, Any] | None) -> str:
    """Where a peak comes from, in one clause: when it was measured, how far apart its three runs
    were, and the load then (a peak measured on a busy machine is low, so MFU comes out high)."""
    if record is None:
        return "measured at start, not cached"
    age = max(0.0, _now() - float(record["measured_at"]))
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(float(record["measured_at"])))
    ago = (f"{age / 86400:.1f} d" if age >= 86400 else f"{age / 3600:.1f} h" if age >= 3600
           else f"{age / 60:.0f} min")
    load = record.get("load")
    cores = os.cpu_count() or 1
    busy = (f"; load {load:g} on {cores} cores then" + (": likely low, delete the cache to measure "
            "again" if load > 0.75 * cores else "")) if isinstance(load, (int, float)) else ""
    return (f"measured {when} ({ago} ago), best of {len(record.get('runs', []))} runs "
            f"{100 * float(record.get('spread', 0.0)):.0f} % apart{busy}; cached in "
            f"{cache_dir() / CACHE_FILE} for {MAX_AGE_S // 86400} days")


def peak_flops(dtype: torch.dtype, device: torch.device | str | None = None, *,
               use_cache: bool = True, refresh: bool = False) -> float:
    """Measured GEMM FLOP/s for ``dtype`` on ``device``, cached on disk after the first call.

    Sizes adapt to the hardware: the matrix grows until one product takes a few milliseconds, so
    an emulated BF16 GEMM on a CPU does not take minutes to measure. The best of three runs at that
    size counts. A cached value older than :data:`MAX_AGE_S` (or from a cache without dates) is
    measured again. A measurement taken while other jobs share the machine comes out low, so
    ``refresh=True`` measures again and keeps the higher of the new and the cached value (the
    trainer does this when it sees an MFU above 100%).
    """
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    key = _cache_key(dtype, device)
    path = cache_dir() / CACHE_FILE
    cached = _read_cache(path) if use_cache else {}
    old = cached.get(key) if _fresh(cached.get(key)) else None
    if old is not None and not refresh:
        _LOW.pop(key, None)                       # a cached peak was judged when it was measured
        return float(old["flops"])
    n, best = 256, 0.0
    while True:
        flops = matmul_flops(dtype, device, n=n, min_time=0.1)
        best = max(best, flops)
        if 2.0 * n**3 / flops > 0.02 or n >= 4096:  # one product takes > 20 ms: big enough
            break
        n *= 2
    # Best of three at the final size: noise only ever slows a GEMM down.
    runs = [best, *(matmul_flops(dtype, device, n=n, min_time=0.1) for _ in range(2))]
    best = max(runs)
    if use_cache:
        label = dtype_name(dtype)
        best = _judged(best, label, device, lambda: max(
            matmul_flops(dtype, device, n=n, min_time=0.1) for _ in range(3)))
        if old is not None and float(old["flops"]) >= best:
            _LOW.pop(key, None)
            return float(old["flops"])            # the cached one was measured on a quieter machine
        if _cache_key(dtype, device) in _LOW:     # likely low: used by no MFU, kept by no cache
            return best
        cached[key] = {"flops": best, "measured_at": _now(), "runs": runs, "n": n,
                       "spread": (best - min(runs)) / best, "load": _load(),
                       "threads": torch.get_num_threads(), "torch": torch.__version__}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(cached, indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only home only costs a re-measurement next time
    return best


def no_peak_reason(fmt: str, device: torch.device | str | None = None) -> str | None:
    """Why ``fmt``'s GEMMs have no honest peak on ``device`` (so MFU is not measured), or None.

    A peak is the rate of the hardware's own instructions for the format. Where the device has
    none and software emulates the format (FP8 without FP8 tensor cores, BF16 on a CPU without
    AVX512-BF16/AMX, FP16 without AVX512-FP16/AMX-FP16), a "peak" would be the emulation's speed
    at one matrix shape, which other shapes beat: an MFU against it can pass 100 %."""
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if fmt == "fp8" and (device.type != "cuda" or not hardware.cuda_supports_fp8()):
        return "FP8 GEMMs are emulated on this device (no FP8 tensor cores)"
    if device.type == "cpu" and fmt == "bf16" and not hardware.cpu_has_native_bf16():
        return "BF16 GEMMs are emulated on this CPU (no AVX512-BF16/AMX instructions)"
    if device.type == "cpu" and fmt == "fp16" and not hardware.cpu_has_native_fp16():
        return "FP16 GEMMs are emulated on this CPU (no AVX512-FP16/AMX-FP16 instructions)"
    if fmt not in ("fp8", "tf32", "fp32", "bf16", "fp16"):
        return f"no {fmt} GEMM peak is measured (block-scaled formats are emulated here)"
    return None


def format_peak_flops(fmt: str, device: torch.device | str | None = None, *,
                      refresh: bool = False) -> float | None:
    """Measured dense peak of ``fmt``'s GEMMs on ``device`` (``fmt``: what
    :attr:`mixprec.Precision.layers.peak_format` says, ``fp8``, ``tf32``, ``bf16``, ``fp16`` or ``fp32``),
    or None where the device has no such GEMMs (:func:`no_peak_reason` says why: emulated, so an
    MFU against it would mean nothing). ``fit()``'s MFU and ``mixprec estimate --gpu cpu`` use this."""
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if no_peak_reason(fmt, device) is not None:
        return None
    if fmt == "fp8" or (fmt == "tf32" and device.type == "cuda"):
        dt = None if fmt == "fp8" else torch.float32
        measure = lambda: max(time_matmul(fmt, dt, device, 4096, 0.2) for _ in range(3))  # noqa: E731
        value = _judged(measure(), fmt, device, measure)
    else:                                          # TF32 is a CUDA mode: FP32 on a CPU
        value = peak_flops(torch.float32 if fmt == "tf32" else parse_dtype(fmt), device, refresh=refresh)
    return None if low_peak_reason(fmt, device) is not None else value


def format_peak_source(fmt: str, device: torch.device | str) -> str:
    """Where :func:`format_peak_flops`'s value for ``fmt`` on ``device`` comes from
    (:func:`describe_peak`; FP8 and CUDA TF32 are measured at every start, not cached)."""
    device = torch.device(device)
    if fmt == "fp8" or (fmt == "tf32" and device.type == "cuda"):
        return "measured at start, not cached"
    return describe_peak(peak_record(torch.float32 if fmt == "tf32" else parse_dtype(fmt), device))
