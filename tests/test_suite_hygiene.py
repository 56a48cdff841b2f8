"""The suite never writes outside its temporary folders: mixprec's cache is the session's."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mixprec.data import corpus
from mixprec.policy import peak


def test_the_mixprec_cache_is_a_session_temp_folder_not_the_users(session_cache_dir, tmp_path_factory):
    home_cache = Path.home() / ".cache" / "mixprec"
    base = tmp_path_factory.getbasetemp().resolve()
    for where in (corpus.default_cache_dir(), peak.cache_dir()):
        assert where == session_cache_dir
        assert where.resolve().is_relative_to(base) and not where.resolve().is_relative_to(home_cache)


def test_a_subprocess_the_suite_starts_uses_the_session_cache(session_cache_dir):
    out = subprocess.run([sys.executable, "-c", "from mixprec.policy import peak; print(peak.cache_dir())"],
                         capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert Path(out.stdout.strip()) == session_cache_dir


def test_the_builtin_corpus_is_built_in_the_session_cache(session_cache_dir):
    built = corpus.builtin_corpus()
    assert built.train_path.is_relative_to(session_cache_dir)


def test_the_cache_is_set_before_test_modules_are_imported(session_cache_dir):
    # tests/hf/test_hf_cli.py builds its subprocess environment at import time.
    assert os.environ.get("MIXPREC_CACHE") == str(session_cache_dir)
    assert _AT_IMPORT == str(session_cache_dir)


_AT_IMPORT = os.environ.get("MIXPREC_CACHE")
