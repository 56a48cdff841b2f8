"""The model a benchmark builds, named in one string: a preset and, optionally, fields changed.

``gpt2-355m`` is the preset; ``gpt2-355m:num_layers=12,max_seq_len=2048`` the preset with two
:class:`~mixprec.models.TransformerConfig` fields replaced. One string, because ``bench train``
passes its configuration to a fresh process per contender for the memory measurement (JSON), and
because a script (benchmarks/gpu/run_all.py) can then name any shape without new flags.
"""
from __future__ import annotations

from mixprec.errors import ConfigError
from mixprec.models.config import TransformerConfig, get_model_config

__all__ = ["model_config"]


def _value(text: str) -> bool | int | float | str:
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(low)
        except ValueError:
            pass
    return text.strip()


def model_config(spec: str) -> TransformerConfig:
    """``PRESET`` or ``PRESET:FIELD=VALUE,...`` -> the validated config (unknown presets and
    fields are refused in one line with the valid names)."""
    name, _, fields = str(spec).partition(":")
    overrides = {}
    for item in filter(None, (f.strip() for f in fields.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"model field '{item}' in --model {spec!r} is not FIELD=VALUE "
                              "(e.g. gpt2-355m:num_layers=12,max_seq_len=2048)")
        overrides[key.strip()] = _value(value)
    return get_model_config(name, **overrides)
