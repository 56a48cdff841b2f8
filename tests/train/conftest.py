import random
from pathlib import Path

import pytest

_WORDS = ("the model trains in mixed precision while the loss scale grows and backs off; "
          "gradients are unscaled once, clipped, and the optimizer steps on fp32 master weights. "
          "def step(batch): return loss . every layer keeps its norm in float32 and its matmuls "
          "in bfloat16 or float16 with dynamic loss scaling").split()


def synthetic_text(n_words: int, seed: int = 0) -> str:
    """Deterministic text (same bytes on every Python version): a fixed-seed word salad."""
    rng = random.Random(seed)
    lines, line = [], []
    for _ in range(n_words):
        line.append(_WORDS[rng.randrange(len(_WORDS))])
        if len(line) >= 12:
            lines.append(" ".join(line))
            line = []
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def text_corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(synthetic_text(40_000))
    return path
