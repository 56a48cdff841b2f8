"""Suite-wide fixtures.

The suite never writes outside its temporary folders: mixprec's on-disk cache (``$MIXPREC_CACHE``,
``~/.cache/mixprec`` when unset: the measured MFU peaks, the built-in corpus) points at one temporary
folder per test session. One per session, not per test, so the built-in corpus is built once and
shared by every test that trains on it; a test that needs an empty cache sets its own.

It is set when pytest starts, before any test module is imported: modules that build a
subprocess environment at import (``ENV = {**os.environ, ...}``) get it too.

Tests marked ``cuda`` need a CUDA GPU and are skipped, saying so, without one (``./run test`` runs
them wherever ``torch.cuda.is_available()``; benchmarks/gpu/run_all.py runs them on a lent GPU).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

CACHE_ENV = "MIXPREC_CACHE"


@pytest.hookimpl(trylast=True)          # after pytest's tmp_path plugin is configured
def pytest_configure(config):
    config._mixprec_cache_before = os.environ.get(CACHE_ENV)
    config._mixprec_cache = config._tmp_path_factory.mktemp("mixprec-cache")
    os.environ[CACHE_ENV] = str(config._mixprec_cache)


def pytest_unconfigure(config):
    before = getattr(config, "_mixprec_cache_before", None)
    if before is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = before


@pytest.fixture(scope="session")
def session_cache_dir(pytestconfig) -> Path:
    """The session's mixprec cache folder (``$MIXPREC_CACHE`` in every test and its subprocesses)."""
    return pytestconfig._mixprec_cache


@pytest.fixture(autouse=True)
def _test_cache_env(session_cache_dir, monkeypatch):
    # Per test as well: a test that unsets or moves the cache gets the session's back afterwards.
    monkeypatch.setenv(CACHE_ENV, str(session_cache_dir))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
