"""The ``./run`` script: ``./run test PATH`` runs that path only, not the whole suite."""
import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _fake_venv(tmp_path: Path) -> Path:
    """A venv folder whose python is this interpreter and whose stamp matches pyproject.toml, so
    ``./run`` installs nothing (the shared venv is never touched)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:16]
    (venv / ".mixprec-installed").write_text(digest + "\n")
    return venv


def _run_test(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MIXPREC_VENV": str(_fake_venv(tmp_path)), "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(ROOT / "run"), "test", *args], capture_output=True, text=True,
                          env=env, timeout=120, cwd=ROOT)


def test_run_test_with_a_path_collects_only_that_file(tmp_path):
    proc = _run_test(tmp_path, "--collect-only", "-q", "tests/amp/test_clip.py")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    # `./run` adds -q, so -q here gives pytest's per-file listing: "tests/amp/test_clip.py: 10"
    files = [line.split(":")[0] for line in proc.stdout.splitlines() if ".py" in line]
    assert files == ["tests/amp/test_clip.py"], proc.stdout[-2000:]
    assert "[run] installing" not in proc.stderr

