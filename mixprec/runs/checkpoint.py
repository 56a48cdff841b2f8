"""Checkpoints that survive crashes: one folder per step, written aside and renamed into place.

Layout under a run folder (see docs/checkpoints.md)::

    checkpoints/
      latest                      text file naming the newest complete folder ("step-00000200")
      step-00000100/
        model.safetensors         model weights (tied tensors stored once, aliases in metadata)
        state.pt                  everything else, loadable with torch.load(weights_only=True)
        meta.json                 format version, step, size + sha256 of each file, versions

Why this shape: a save is first written into ``checkpoints/.tmp-step-XXXXXXXX-<pid>/``, every
file is fsynced, then the folder is renamed into place (a rename is atomic on POSIX file systems)
and only then is ``latest`` replaced. A crash at any instant leaves either the old state or the
new one, never a half-written folder under a ``step-*`` name. ``meta.json`` records the size and
SHA-256 of each file so a truncated or bit-flipped checkpoint is reported by name on load instead
of surfacing as a confusing unpickling error (or, worse, as silently wrong weights).

Everything in ``state.pt`` must load under ``torch.load(weights_only=True)``, which refuses
arbitrary classes. :func:`capture_rng_state` turns every random generator's state into plain
tensors / lists so the RNG streams resume exactly; :func:`save_checkpoint` checks the whole
training state against the allowlist *before* writing, naming the offending key.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mixprec import hints
from mixprec.errors import CheckpointError, excerpt
from mixprec.runs.owned import LATEST_FILE, META_FILE, MODEL_FILE, STATE_FILE, delete_checkpoint

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "list_checkpoints",
    "resolve_checkpoint",
    "capture_rng_state",
    "restore_rng_state",
    "FORMAT_VERSION",
]

FORMAT_VERSION = 1
_ALIAS_KEY = "mixprec.aliases"
_PREFIX = "step-"

# Types torch.load(weights_only=True) accepts (checked against torch 2.6-2.13). Exact types only:
# subclasses such as defaultdict or numpy scalars are refused by the unpickler.
_SAFE_LEAVES = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.Size)
_SAFE_CONTAINERS = (dict, OrderedDict, list, tuple, set)
_SAFE_TENSORS = (torch.Tensor, torch.nn.Parameter)


def step_dir_name(step: int) -> str:
    """``step-00000100``: zero-padded so folder names sort by step in any file browser."""
    return f"{_PREFIX}{step:08d}"


def _parse_step(name: str) -> int | None:
    if not name.startswith(_PREFIX):
        return None
    digits = name[len(_PREFIX):]
    return int(digits) if digits.isdigit() else None


# ---------------------------------------------------------------------------------------------
# RNG state
# ---------------------------------------------------------------------------------------------

def capture_rng_state() -> dict[str, Any]:
    """Snapshot python ``random``, numpy's global generator, torch CPU and every CUDA device.

    The result holds only ints, floats, strings, lists and uint8 tensors, so it round-trips
    through ``torch.load(weights_only=True)`` (numpy's uint32 key array is stored as an int64
    tensor; python's state tuple as lists).
    """
    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": [],
    }
    if torch.cuda.is_available():
        # get_rng_state_all initialises CUDA; that is fine when a GPU is there to be used.
        state["torch_cuda"] = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng_state` captured; the next draws equal the captured run's."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npst = state["numpy"]
    keys = npst["keys"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((npst["kind"], keys.astype(np.uint32), npst["pos"], npst["has_gauss"],
                         npst["cached_gaussian"]))
    torch.set_rng_state(state["torch_cpu"].cpu())
    cuda_states = state.get("torch_cuda") or []
    if cuda_states:
        if not torch.cuda.is_available():
            raise CheckpointError(
                "the checkpoint holds CUDA RNG states but no GPU is visible; resume on a machine "
                "with the same number of GPUs, or drop 'torch_cuda' from the RNG state")
        if len(cuda_states) != torch.cuda.device_count():
            raise CheckpointError(
                f"the checkpoint holds RNG states for {len(cuda_states)} CUDA devices but "
                f"{torch.cuda.device_count()} are visible; set CUDA_VISIBLE_DEVICES to match")
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda_states])


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------

def _check_weights_only_safe(obj: Any, where: str) -> None:
    """Raise CheckpointError naming the first value torch.load(weights_only=True) would refuse."""
    kind = type(obj)
    if kind in _SAFE_LEAVES:
        return
    if kind in _SAFE_TENSORS:
        return
    if kind in _SAFE_CONTAINERS:
        if kind in (dict, OrderedDict):
            for key, value in obj.items():
                if type(key) not in _SAFE_LEAVES:
                    raise CheckpointError(
                        f"train_state{where} has a key of type {kind.__name__}"
                        f"[{type(key).__name__}]; use str or int keys")
                _check_weights_only_safe(value, f"{where}[{key!r}]")
        else:
            for i, value in enumerate(obj):
                _check_weights_only_safe(value, f"{where}[{i}]")
        return
    hint = "convert it with .item() / .tolist()" if kind.__module__.startswith("numpy") else \
        "convert it to str, a number, a list or a tensor"
    raise CheckpointError(
        f"train_state{where} is a {kind.__module__}.{kind.__qualname__}, which "
        f"torch.load(weights_only=True) refuses; {hint}")


def _dedupe_shared(model_state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Store each shared tensor once: returns (tensors to write, alias -> canonical name).

    Tied weights (e.g. embedding and output head) are the same storage viewed identically; the
    first name in state-dict order becomes canonical and later names are recorded as aliases.
    Different views of one storage (a fused buffer split into parts) are cloned separately, since
    safetensors cannot express overlapping regions.
    """
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in model_state.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(
                f"model_state[{name!r}] is a {type(t).__name__}, not a tensor; put non-tensor "
                "values in train_state")
        t = t.detach()
        if t.numel() == 0:
            tensors[name] = t.cpu().contiguous()
            continue
        view = (t.device.type, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if view in seen:
            aliases[name] = seen[view]
            continue
        seen[view] = name
        tensors[name] = t.cpu().contiguous()
    # A contiguous CPU tensor is returned as-is by .contiguous(), so two different views of one
    # storage would still overlap and save_file would refuse them: clone those.
    counts: dict[int, int] = {}
    for t in tensors.values():
        if t.numel():
            ptr = t.untyped_storage().data_ptr()
            counts[ptr] = counts.get(ptr, 0) + 1
    for name, t in tensors.items():
        if t.numel() and counts[t.untyped_storage().data_ptr()] > 1:
            tensors[name] = t.clone()
    return tensors, aliases


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # some platforms cannot open directories; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _versions() -> dict[str, str]:
    try:
        from importlib.metadata import version
        mixprec_version = version("mixprec")
    except Exception:  # running from a source tree that is not installed
        mixprec_version = "unknown"
    return {"mixprec": mixprec_version, "torch": torch.__version__}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_tmp(ckpt_dir: Path) -> None:
    """Delete temporaries left by saves whose process died (crash or SIGKILL mid-save)."""
    for entry in [*ckpt_dir.glob(".tmp-*"), *ckpt_dir.glob(f".{LATEST_FILE}.tmp-*")]:
        pid = entry.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _write_latest(ckpt_dir: Path, name: str) -> None:
    tmp = ckpt_dir / f".{LATEST_FILE}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt_dir / LATEST_FILE)
    _fsync_dir(ckpt_dir)


_MiB = 2**20
_FULL_DISK_TEXT = ("unexpected pos", "PytorchStreamWriter failed writing", "file write failed")
"""torch.save's own words when a write came up short (its zip writer does not raise OSError):
``[enforce fail at inline_container.cc:672] . unexpected pos 78912 vs 78864``."""


def _state_bytes(obj: Any) -> int:
    """The tensor bytes in a (nested) state: about what a checkpoint of it takes on disk."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_state_bytes(v) for v in obj)
    return 0


def _free_bytes(path: Path) -> int | None:
    """Free bytes on the file system of ``path`` (its nearest existing parent); None if unknown."""
    for p in (path, *path.parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


def _no_space(where: Path, needed: int) -> str:
    free = _free_bytes(where)
    free_text = f", free {free / _MiB:.0f} MiB" if free is not None else ""
    return (f"no space left on device writing {where} (needed ~{needed / _MiB:.0f} MiB{free_text}): "
            "free space, write the run elsewhere (run_dir=PATH) or keep fewer checkpoints (keep_last=1)")


def _describe_failure(exc: BaseException, where: Path, needed: int) -> str:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return _no_space(where, needed) + ("" if exc.errno == errno.ENOSPC else " (disk quota full)")
    if isinstance(exc, RuntimeError) and any(t in str(exc) for t in _FULL_DISK_TEXT):
        return _no_space(where, needed)
    if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (f"{exc.strerror or 'permission denied'} writing {where}; choose a writable run folder "
                "(run_dir=PATH)")
    if isinstance(exc, CheckpointError):
        return str(exc)
    return f"{type(exc).__name__}: {excerpt(exc)}"


def save_checkpoint(run_dir: str | os.PathLike, step: int, *, model_state: dict[str, torch.Tensor],
                    train_state: dict, keep_last: int | None = 3) -> Path:
    """Write ``checkpoints/step-XXXXXXXX/`` atomically, point ``latest`` at it, prune old ones.

    ``model_state`` is a flat name -> tensor mapping (a ``state_dict()``); tensors may live on any
    device and share storage. ``train_state`` holds everything else and must be
    ``weights_only``-loadable (checked first). ``keep_last=None`` keeps every checkpoint.
    Returns the new folder. On any failure the temporary folder is removed, earlier checkpoints
    and ``latest`` are untouched, and :class:`CheckpointError` says why in one line.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"checkpoint step must be a non-negative int, got {step!r}")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise CheckpointError(f"keep_last must be a positive int or None, got {keep_last!r}")
    _check_weights_only_safe(train_state, "")
    ckpt_dir = Path(run_dir) / "checkpoints"
    name = step_dir_name(step)
    final = ckpt_dir / name
    tmp = ckpt_dir / f".tmp-{name}-{os.getpid()}"
    previous = _read_latest(ckpt_dir)
    needed = _state_bytes(model_state) + _state_bytes(train_state)
    free = _free_bytes(ckpt_dir)
    if free is not None and needed > free:   # refuse before writing a byte
        raise CheckpointError(f"could not save checkpoint {name}: {_no_space(ckpt_dir, needed)}")
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp(ckpt_dir)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        tensors, aliases = _dedupe_shared(model_state)
        metadata = {"format": "mixprec", "format_version": str(FORMAT_VERSION), "step": str(step),
                    _ALIAS_KEY: json.dumps(aliases, sort_keys=True)}
        save_file(tensors, str(tmp / MODEL_FILE), metadata=metadata)
        _fsync_file(tmp / MODEL_FILE)
        with open(tmp / STATE_FILE, "wb") as f:
            torch.save(train_state, f)
            f.flush()
            os.fsync(f.fileno())
        files = {fname: {"bytes": (tmp / fname).stat().st_size, "sha256": _sha256(tmp / fname)}
                 for fname in (MODEL_FILE, STATE_FILE)}
        meta = {"format_version": FORMAT_VERSION, "step": step, "files": files,
                "aliases": aliases, "versions": _versions()}
        with open(tmp / META_FILE, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists() and not (final / META_FILE).is_file():
            # An incomplete folder of this step (the resume said so): kept, under another name.
            os.replace(final, _free_name(ckpt_dir / f"incomplete-{name}"))
        if final.exists():
            # Saving a step that already exists (re-run after a resume): move the old one aside
            # first; if we die in between, load falls back to the newest complete folder.
            aside = ckpt_dir / f".tmp-old-{name}-{os.getpid()}"
            os.replace(final, aside)
            os.replace(tmp, final)
            if delete_checkpoint(aside):   # a file of yours in the old folder: kept, renamed
                os.replace(aside, _free_name(ckpt_dir / f"replaced-{name}"))
        else:
            os.replace(tmp, final)
        _fsync_dir(ckpt_dir)
        _write_latest(ckpt_dir, name)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        intact = (f"the previous checkpoint {previous} is intact" if previous and (ckpt_dir / previous).is_dir()
                  else "no earlier checkpoint was touched")
        raise CheckpointError(
            f"could not save checkpoint {name}: {_describe_failure(exc, ckpt_dir, needed)} — {intact}") from exc
    if keep_last is not None:
        _prune(ckpt_dir, keep_last, newest=step)
    return final


def _free_name(path: Path) -> Path:
    n = 1
    candidate = path
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def _prune(ckpt_dir: Path, keep_last: int, *, newest: int) -> None:
    """Delete complete checkpoints older than the newest ``keep_last`` (up to ``newest``).

    Folders with a step above ``newest`` (left by a run that went further before being resumed
    from an earlier step) are never deleted here: they are someone's data, not ours to judge. A
    checkpoint's folder loses only the files a save wrote (:func:`mixprec.runs.owned.delete_checkpoint`):
    anything else in it stays, with the folder.
    """
    older = [(s, p) for s, p in list_checkpoints(ckpt_dir) if s <= newest]
    for _, path in older[:-keep_last]:
        delete_checkpoint(path)      # its own files; a folder that also holds yours stays


# ---------------------------------------------------------------------------------------------
# Finding and loading
# ---------------------------------------------------------------------------------------------

def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run (or of a ``checkpoints`` folder) as (step, folder), oldest first."""
    root = Path(run_dir)
    ckpt_dir = root / "checkpoints" if (root / "checkpoints").is_dir() else root
    if not ckpt_dir.is_dir():
        return []
    found = []
    for entry in ckpt_dir.iterdir():
        step = _parse_step(entry.name)
        if step is not None and entry.is_dir() and (entry / META_FILE).is_file():
            found.append((step, entry))
    return sorted(found)


def run_of_checkpoint(path: str | os.PathLike) -> Path | None:
    """The run folder ``path`` belongs to when it is that run's ``checkpoints/`` folder or one of
    its ``checkpoints/step-N`` folders (None for anything else, a run folder included): what a
    ``run_dir`` or ``--resume`` pointing into a run's checkpoints continues."""
    path = Path(path)
    if path.name == "checkpoints":
        run = path.parent
    elif _parse_step(path.name) is not None and path.parent.name == "checkpoints":
        run = path.parent.parent
    else:
        return None
    return run if (run / "config.toml").is_file() else None


def _read_latest(ckpt_dir: Path) -> str | None:
    try:
        name = (ckpt_dir / LATEST_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return name or None


def _resolve(path: Path) -> Path:
    """Turn a run folder, a checkpoints folder or a step folder into a step folder."""
    return resolve_checkpoint(path)[0]


def resolve_checkpoint(path: Path) -> tuple[Path, str | None]:
    """The step folder a run folder, checkpoints folder or step folder stands for, and, when
    newer ``step-*`` folders are incomplete (no ``meta.json``: a save that did not finish, or a
    folder someone emptied), one line saying which checkpoint is used instead and why (None when
    nothing was passed over). Incomplete folders are left as they are: a later save of the same
    step moves one aside to ``incomplete-step-N`` instead of deleting it."""
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}; pass a run folder, its checkpoints/ folder "
                              "or a checkpoints/step-XXXXXXXX folder")
    if (path / META_FILE).is_file() or _parse_step(path.name) is not None:
        step = _parse_step(path.name)
        newer = [p.name for s, p in list_checkpoints(path.parent) if step is not None and s > step]
        return path, (f"resuming from {path.name}; the newer checkpoints {', '.join(newer)} are from "
                      "the run's earlier course: each is replaced when this run saves its step"
                      if newer else None)
    ckpt_dir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    latest = _read_latest(ckpt_dir)
    complete = list_checkpoints(ckpt_dir)
    if latest and (ckpt_dir / latest / META_FILE).is_file():
        return ckpt_dir / latest, None          # the newest save of this run's timeline
    if not complete:
        raise CheckpointError(f"no complete checkpoint under {ckpt_dir}; train with checkpointing "
                              "enabled first, or pass the folder that holds checkpoints/")
    chosen_step, chosen = complete[-1]
    skipped = sorted(e.name for e in ckpt_dir.iterdir() if e.is_dir() and not (e / META_FILE).is_file()
                     and (_parse_step(e.name) or -1) > chosen_step)
    named = (f"; `latest` names {latest}" if latest and latest != chosen.name else "")
    if not skipped and not named:
        return chosen, None
    why = (f"{', '.join(skipped)} {'has' if len(skipped) == 1 else 'have'} no {META_FILE} (a save "
           "that did not finish)" if skipped else f"`latest` names {latest}, which is not a "
           "complete checkpoint")
    return chosen, (f"resuming from {chosen.name}, the newest complete checkpoint: {why}"
                    f"{named if skipped else ''}; the incomplete folder is kept (moved to "
                    f"incomplete-<name> if this run saves that step again)")


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step a resume from ``path`` (a run folder, its checkpoints/ folder or a step folder)
    continues at: its chosen checkpoint's, as :func:`resolve_checkpoint` picks it; None when it
    holds no complete checkpoint. Reads folder names only."""
    try:
        step_dir, _ = resolve_checkpoint(Path(path))
    except CheckpointError:
        return None
    return _parse_step(step_dir.name)


def _earlier_hint(step_dir: Path) -> str:
    step = _parse_step(step_dir.name)
    earlier = [p for s, p in list_checkpoints(step_dir.parent) if step is None or s < step]
    if earlier:
        return f"resume from the previous checkpoint: {hints.resume(earlier[-1], checkpoint=True)}"
    return "no earlier checkpoint exists; restart the run"


def _verify(step_dir: Path, meta: dict) -> None:
    for fname in (MODEL_FILE, STATE_FILE):
        path = step_dir / fname
        expected = meta.get("files", {}).get(fname)
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing; {_earlier_hint(step_dir)}")
        if expected is None:
            raise CheckpointError(f"{step_dir / META_FILE} does not list {fname}; {_earlier_hint(step_dir)}")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"checkpoint file {path} is truncated or altered ({size} bytes, expected "
                                  f"{expected['bytes']}); {_earlier_hint(step_dir)}")
        if _sha256(path) != expected["sha256"]:
            raise CheckpointError(f"checkpoint file {path} is corrupt (sha256 mismatch); "
                                  f"{_earlier_hint(step_dir)}")


def load_checkpoint(path: str | os.PathLike, *, device: str | torch.device = "cpu",
                    verify: bool = True) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """Load ``(model_state, train_state, meta)`` from a run folder, checkpoints folder or step folder.

    A run folder follows ``latest``; if that file is missing or names a folder that is gone, the
    newest complete ``step-*`` folder is used. With ``verify`` (the default) every file's size
    and SHA-256 are checked against ``meta.json`` first. Tied tensors come back as one tensor
    under every name. Tensors are placed on ``device`` (state.pt tensors stay on CPU; optimizer
    and scheduler ``load_state_dict`` move them where their parameters live).
    """
    step_dir = _resolve(Path(path))
    meta_path = step_dir / META_FILE
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint metadata {meta_path} is unreadable ({type(exc).__name__}); "
                              f"{_earlier_hint(step_dir)}") from exc
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{step_dir} was written by a newer mixprec (format "
                              f"{meta.get('format_version')}, this one reads {FORMAT_VERSION}); upgrade mixprec")
    if verify:
        _verify(step_dir, meta)
    model_path = step_dir / MODEL_FILE
    try:
        model_state: dict[str, torch.Tensor] = {}
        with safe_open(str(model_path), framework="pt", device=str(device)) as f:
            aliases = json.loads((f.metadata() or {}).get(_ALIAS_KEY, "{}"))
            for key in f.keys():
                model_state[key] = f.get_tensor(key)
    except Exception as exc:
        raise CheckpointError(f"checkpoint file {model_path} cannot be read ({type(exc).__name__}: "
                              f"{excerpt(exc, 160)}); {_earlier_hint(step_dir)}") from exc
    for alias, canonical in aliases.items():
        model_state[alias] = model_state[canonical]
    state_path = step_dir / STATE_FILE
    try:
        train_state = torch.load(state_path, map_location="cpu", weights_only=True)
    except Exception as exc:
        # torch names the refused global on a line of its own, after its advice: that line first
        lines = [line for line in str(exc).splitlines() if "GLOBAL" in line or "global" in line]
        raise CheckpointError(f"checkpoint file {state_path} cannot be read ({type(exc).__name__}: "
                              f"{excerpt(lines[0] if lines else exc, 160)}); {_earlier_hint(step_dir)}") from exc
    return model_state, train_state, meta
