"""One-line errors quote other libraries' messages in whole sentences, never cut mid-word.

The four cuts a user met: "...because your version", "Re-running `torch.);", `"blocks.);` and
"This is );" (a message sliced at a fixed length, then `); fix` appended).
"""
import io
import json
import os
import re
from pathlib import Path

import pytest
import torch

from mixprec.errors import ConfigError, excerpt

SOURCE = Path(__file__).resolve().parents[2] / "mixprec"


def _is_whole_words_prefix(short: str, full: str) -> bool:
    """``short`` is ``full``'s first words (line breaks folded), or those and a final ``...``."""
    words, original = short.removesuffix(" ...").split(), " ".join(full.split()).split()
    if words == original[:len(words)]:
        return True
    # the last kept word may lose a trailing comma/semicolon when the cut is after an item
    return words[:-1] == original[:len(words) - 1] and original[len(words) - 1].rstrip(",;:") == words[-1]


def _torch_weights_only_error() -> Exception:
    buf = io.BytesIO()
    torch.save({"x": os.getcwd}, buf)
    buf.seek(0)
    with pytest.raises(Exception) as info:
        torch.load(buf, weights_only=True)
    return info.value


def _state_dict_error() -> Exception:
    model = torch.nn.ModuleDict({"blocks": torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(40)])})
    with pytest.raises(RuntimeError) as info:
        model.load_state_dict({})
    return info.value


@pytest.mark.parametrize("make", [_torch_weights_only_error, _state_dict_error])
@pytest.mark.parametrize("limit", [40, 160, 240])
def test_excerpt_of_real_errors_is_whole_words(make, limit):
    error = make()
    short = excerpt(error, limit)
    assert len(short) <= limit + 4
    assert _is_whole_words_prefix(short, str(error)), short
    assert short.count('"') % 2 == 0 and short.count("`") % 2 == 0, short   # no quote left open


def test_excerpt_keeps_whole_sentences():
    text = ("The checkpoint you are trying to load has model type `nope` but Transformers does not "
            "recognize this architecture. This could be because of an issue with the checkpoint, or "
            "because your version of Transformers is out of date.\n\nYou can update Transformers.")
    short = excerpt(text, 200)
    assert short.endswith("architecture.") and "because your" not in short
    assert excerpt("This is short.") == "This is short."
    assert excerpt(RuntimeError()) == "RuntimeError"


def test_transformers_unknown_model_type_is_one_complete_line(tmp_path):
    pytest.importorskip("transformers")
    from mixprec.models.hf import load_hf_config
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(ConfigError) as info:
        load_hf_config(f"hf:{config}")
    message = str(info.value)
    assert "\n" not in message
    assert message.rstrip().endswith((".", "...")), message
    assert "because your version" not in message or "out of date" in message


def test_checkpoint_with_a_refused_global_names_it_in_whole_words(tmp_path):
    from mixprec.errors import CheckpointError
    from mixprec.runs.checkpoint import load_checkpoint, save_checkpoint
    model = torch.nn.Linear(2, 2)
    step_dir = save_checkpoint(tmp_path / "run", 1, model_state=model.state_dict(), train_state={"step": 1})
    torch.save({"x": os.getcwd}, Path(step_dir) / "state.pt")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(step_dir, verify=False)
    message = str(info.value)
    assert "getcwd" in message and "`torch.)" not in message and "\n" not in message


# A message sliced at a fixed length (`text[:200]`, `str(e)[:160]`, `splitlines()[0][:300]`) is how
# the cuts happened; every quote of another library's message goes through errors.excerpt instead.
_SLICED = re.compile(r"(?:str\(\w+\)|\bfirst|\btext|\bmessage|\bmsg|\breason|splitlines\(\)\[0\])\[:\d+\]")


def test_no_message_is_sliced_at_a_fixed_length_outside_excerpt():
    offenders = [f"{path.relative_to(SOURCE.parent)}:{n}: {line.strip()}"
                 for path in SOURCE.rglob("*.py") for n, line in enumerate(path.read_text().splitlines(), 1)
                 if _SLICED.search(line) or "splitlines()[0]" in line and "str(" in line]
    assert not offenders, "\n".join(offenders)
