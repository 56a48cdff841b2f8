"""examples/hf_causal_lm.py runs as written, and its fit() and hand-written loop agree exactly."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_causal_lm.py"


def test_hf_example_runs_and_fit_matches_the_hand_written_loop(tmp_path):
    # On the CPU (hidden GPUs): the loop's and fit()'s losses are exactly equal there.
    env = {**os.environ, "OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": ""}
    # As on its second run: the folder holds the first run's files (it starts over, not crash).
    earlier = tmp_path / "runs" / "hf_causal_lm"
    earlier.mkdir(parents=True)
    (earlier / "config.toml").write_text('precision = "bf16-mixed"\n')
    (earlier / "metrics.csv").write_text("step,loss\n1,5.5\n")
    proc = subprocess.run([sys.executable, str(EXAMPLE)], cwd=tmp_path, capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "same loss as fit(): True" in proc.stdout
    assert "final norm weights in torch.float32" in proc.stdout
    assert (tmp_path / "runs" / "hf_causal_lm" / "hf" / "config.json").is_file()
    assert "1,5.5" not in (earlier / "metrics.csv").read_text()
