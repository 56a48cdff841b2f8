"""Suite-wide fixtures.

The suite never writes outside its temporary folders: mixprec's on-disk cache (``$MIXPREC_CACHE``,
``~/.cache/mixprec`` when unset: the measured MFU peaks, the built-in corpus) points at one temporary
folder per test session. One per session, not per test, so the built-in corpus is built once and
shared by every test that trains on it; a test that needs an empty cache sets its own.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

CACHE_ENV = "MIXPREC_CACHE"


@pytest.fixture(scope="session")
def session_cache_dir(tmp_path_factory) -> Path:
    """The session's mixprec cache folder (``$MIXPREC_CACHE`` in every test and its subprocesses)."""
    return tmp_path_factory.mktemp("mixprec-cache")


@pytest.fixture(scope="session", autouse=True)
def _session_cache_env(session_cache_dir):
    # Set for the whole session, so session-scoped fixtures that build a corpus see it too.
    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(session_cache_dir)
    yield
    if before is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = before


@pytest.fixture(autouse=True)
def _test_cache_env(session_cache_dir, monkeypatch):
    # Per test as well: a test that unsets or moves the cache gets the session's back afterwards.
    monkeypatch.setenv(CACHE_ENV, str(session_cache_dir))
