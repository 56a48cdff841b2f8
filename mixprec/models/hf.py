"""Hugging Face causal LMs in ``mixprec train``: built from a local ``config.json``, optionally
started from a local ``save_pretrained`` folder, exported with ``save_pretrained``.

``model=hf:PATH`` names a ``config.json`` (or a folder holding one). The model is
``AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(PATH))``: random initialisation
from the run's ``seed``, FP32 parameters (the precision mode decides storage afterwards).
``init_from=FOLDER`` loads the weights of a local ``save_pretrained`` folder (safetensors only)
into that architecture instead. Nothing is ever downloaded: ``HF_HUB_OFFLINE=1`` is set before
transformers is imported here, every call passes ``local_files_only=True``, and code from the
Hub (``auto_map`` / ``trust_remote_code``) is refused.

Exports (:func:`export_pretrained`) are written aside and renamed into place, like checkpoints,
so a folder named ``hf`` is always complete; ``AutoModelForCausalLM.from_pretrained(folder)``
loads it. Weights are written in FP32, whatever the mode stored them in: the ``*-true`` modes keep
16-bit weights next to FP32 norms, and a Hugging Face folder has one dtype (``from_pretrained``
would round the FP32 norms to 16 bits), while upcasting 16-bit values is exact. So the folder
holds exactly the weights the run trained, and loading it in BF16 is the user's choice.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.errors import CheckpointError, ConfigError, excerpt

__all__ = ["HF_PREFIX", "is_hf_spec", "is_hf_model", "hf_config_path", "load_hf_config",
           "build_hf_model", "export_pretrained"]

HF_PREFIX = "hf:"


def is_hf_spec(model: str) -> bool:
    """``model=hf:PATH`` names a Hugging Face config rather than a mixprec preset."""
    return model.startswith(HF_PREFIX)


def is_hf_model(model: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (has ``save_pretrained`` and a ``config``)."""
    return (type(model).__module__.startswith("transformers.")
            and callable(getattr(model, "save_pretrained", None)) and hasattr(model, "config"))


def _transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")    # before huggingface_hub reads it
    try:
        import transformers
    except ImportError:
        raise ConfigError("model=hf:... needs the transformers package; pip install "
                          "transformers") from None
    return transformers


def hf_config_path(spec: str) -> Path:
    """The ``config.json`` that ``model=hf:PATH`` names (a file, or a folder holding one)."""
    raw = spec[len(HF_PREFIX):] if is_hf_spec(spec) else spec
    if not raw:
        raise ConfigError("model=hf: needs a path, e.g. model=hf:configs/llama-tiny.json or "
                          "model=hf:FOLDER (a folder with config.json)")
    path = Path(raw).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"model=hf:{raw}: the folder has no config.json; pass a config.json "
                              "or a save_pretrained folder (mixprec train never downloads)")
    elif not path.is_file():
        raise ConfigError(f"model=hf:{raw}: no such file or folder; pass a local config.json or a "
                          "folder with one (mixprec train never downloads)")
    return path


RUN_CONFIG = "hf_config.json"
"""A run folder's copy of the ``config.json`` its ``model=hf:PATH`` named (not the weights): a
resume builds the model from it when PATH has moved or changed."""


def keep_run_config(spec: str, run_dir: Path) -> None:
    """Copy ``model=hf:PATH``'s config.json into ``run_dir`` (:data:`RUN_CONFIG`)."""
    source, copy = hf_config_path(spec), Path(run_dir) / RUN_CONFIG
    if not (copy.exists() and os.path.samefile(source, copy)):
        shutil.copyfile(source, copy)


def resume_spec(spec: str, run_dir: Path) -> tuple[str, str | None]:
    """The ``model=hf:...`` a resume of ``run_dir`` builds, and one line saying why when it is not
    ``spec``: the run folder's copy of the config when ``spec``'s file has moved or changed. A
    config that is gone with no copy kept is refused in one line naming the way out."""
    raw = spec[len(HF_PREFIX):]
    copy = Path(run_dir) / RUN_CONFIG
    try:
        original = hf_config_path(spec)
    except ConfigError:
        if not copy.is_file():
            raise ConfigError(f"cannot resume {run_dir}: its model config {raw} is gone and the run folder "
                              f"keeps no copy ({RUN_CONFIG}); pass model=hf:PATH naming the same "
                              "config.json") from None
        return f"{HF_PREFIX}{copy}", f"{raw} is gone: the model is built from the run folder's copy"
    if copy.is_file() and not os.path.samefile(original, copy) and original.read_bytes() != copy.read_bytes():
        return f"{HF_PREFIX}{copy}", (f"{original} changed since the run began: the model is built "
                                      "from the run folder's copy")
    return spec, None


def load_hf_config(spec: str) -> Any:
    """``AutoConfig`` of ``model=hf:PATH``, read from the local file only."""
    path = hf_config_path(spec)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not a readable JSON file ({type(e).__name__}: {e})") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ConfigError(f"{path} has no \"model_type\" (e.g. \"llama\", \"gpt2\"); it must be a "
                          "Hugging Face config.json")
    if raw.get("auto_map"):
        raise ConfigError(f"{path} asks for custom model code (auto_map); mixprec train only builds "
                          "architectures that ship with transformers")
    transformers = _transformers()
    try:
        return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True,
                                                       trust_remote_code=False)
    except (ValueError, KeyError, OSError) as e:
        raise ConfigError(f"transformers cannot read {path}: {excerpt(e)}") from None


def _causal_lm_class(config: Any, spec: str) -> Any:
    transformers = _transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(f"model={spec}: model_type '{config.model_type}' has no causal-LM head in "
                          "transformers (it is not a decoder-only language model); mixprec train "
                          "trains causal LMs; train other models with fit() on dict batches with "
                          "labels (docs/hf.md)")
    return transformers.AutoModelForCausalLM


def _check_fits_data(config: Any, spec: str, vocab_size: int, seq_len: int) -> None:
    model_vocab = getattr(config, "vocab_size", None)
    if model_vocab is not None and model_vocab < vocab_size:
        raise ConfigError(f"model={spec} has vocab_size={model_vocab} but the data's token ids go up "
                          f"to {vocab_size - 1}; set \"vocab_size\": {vocab_size} (or more) in its "
                          "config.json, or tokenize the data with a matching tokenizer")
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if positions is not None and positions < seq_len:
        raise ConfigError(f"model={spec} handles {positions} positions but seq_len={seq_len}; set "
                          f"seq_len <= {positions} or raise max_position_embeddings/n_positions")


@torch.no_grad()
def _check_causal(model: nn.Module, spec: str, vocab_size: int) -> None:
    """Refuse a model whose position t sees token t+1: an encoder behind a causal-LM head (e.g.
    BERT without ``is_decoder``) would learn next-token prediction by looking at the answer.
    One 8-token forward pass; no global RNG is drawn."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab_size, (1, 8), generator=g)
    y = x.clone()
    y[0, -1] = (x[0, -1] + 1) % vocab_size                   # change only the last token
    was_training = model.training
    model.eval()
    try:
        a = model(input_ids=x, use_cache=False).logits[0, :-1]
        b = model(input_ids=y, use_cache=False).logits[0, :-1]
    finally:
        model.train(was_training)
    if not torch.allclose(a, b, rtol=0, atol=1e-5):
        raise ConfigError(f"model={spec}: {type(model).__name__} lets each position see later tokens "
                          "(not causal), so next-token training would read the answer; set "
                          "\"is_decoder\": true in its config.json or use a decoder-only model")


def build_hf_model(spec: str, *, vocab_size: int, seq_len: int, init_from: str | None = None,
                   gradient_checkpointing: bool = False) -> nn.Module:
    """The causal LM of ``model=hf:PATH`` in FP32, randomly initialised from the current torch
    seed, or with the weights of the local ``save_pretrained`` folder ``init_from``."""
    config = load_hf_config(spec)
    _check_fits_data(config, spec, vocab_size, seq_len)
    auto = _causal_lm_class(config, spec)
    if init_from is None:
        model = auto.from_config(config, dtype=torch.float32, trust_remote_code=False)
    else:
        model = _load_pretrained(auto, config, init_from)
    _check_causal(model, spec, min(vocab_size, getattr(config, "vocab_size", vocab_size)))
    if gradient_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ConfigError(f"{type(model).__name__} does not support gradient checkpointing; "
                              "set gradient_checkpointing=false")
        model.gradient_checkpointing_enable()
    return model


def _load_pretrained(auto: Any, config: Any, folder: str) -> nn.Module:
    path = Path(folder).expanduser()
    if not path.is_dir() or not any(path.glob("*.safetensors")):
        raise ConfigError(f"init_from={folder}: not a folder with .safetensors weights (a "
                          "save_pretrained folder); mixprec never unpickles .bin weights and "
                          "never downloads")
    try:
        with _quiet_progress():
            model, info = auto.from_pretrained(str(path), config=config, dtype=torch.float32,
                                               local_files_only=True, use_safetensors=True,
                                               trust_remote_code=False, output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise ConfigError(f"init_from={folder} does not load into this architecture: "
                          f"{excerpt(e)}") from None
    missing = list(info.get("missing_keys") or [])
    mismatched = [k if isinstance(k, str) else k[0] for k in info.get("mismatched_keys") or []]
    if missing or mismatched:
        bad = (missing + mismatched)[:3]
        raise ConfigError(f"init_from={folder} does not fit the model's config: "
                          f"{len(missing)} weights missing, {len(mismatched)} of another shape "
                          f"(e.g. {', '.join(map(str, bad))}); use the config.json it was saved with")
    return model


def _fp32_state(model: nn.Module, state: dict[str, torch.Tensor] | None
                ) -> dict[str, torch.Tensor] | None:
    """``state`` (default: the model's) with 16-bit floats upcast to FP32, tied tensors still
    shared; None when the model is FP32 already and no state was given."""
    if state is None:
        state = model.state_dict()
        if all(not t.is_floating_point() or t.dtype == torch.float32 for t in state.values()):
            return None
    out: dict[str, torch.Tensor] = {}
    seen: dict[tuple, torch.Tensor] = {}
    for name, t in state.items():
        t = t.detach()
        if not t.is_floating_point() or t.dtype == torch.float32:
            out[name] = t
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if key not in seen:
            seen[key] = t.float()
        out[name] = seen[key]
    return out


@contextlib.contextmanager
def _quiet_progress():
    """No "Writing model shards" bar in the middle of mixprec's own progress bar."""
    from transformers.utils import logging as hf_logging
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def export_pretrained(model: nn.Module, folder: Path,
                      state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """``model.save_pretrained(folder)``, written aside and renamed into place (safetensors).

    ``state_dict``: the full state when the live model is sharded (FSDP2); by default the model's
    own. An existing ``folder`` is replaced only once the new one is complete.
    """
    folder = Path(folder)
    state_dict = _fp32_state(model, state_dict)
    tmp = folder.parent / f".tmp-{folder.name}-{os.getpid()}"
    old = folder.parent / f".old-{folder.name}-{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        folder.parent.mkdir(parents=True, exist_ok=True)
        with _quiet_progress():
            model.save_pretrained(str(tmp), state_dict=state_dict)
        if state_dict is not None:   # the config names the dtype the folder holds
            config = json.loads((tmp / "config.json").read_text(encoding="utf-8"))
            config["dtype"] = "float32"
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n",
                                             encoding="utf-8")
        if folder.exists():
            os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not export the Hugging Face model to {folder}: "
                              f"{e.strerror or e}") from e
    return folder
