"""Suite-wide: tests marked ``cuda`` need a CUDA GPU and are skipped, saying so, without one
(``./run test`` runs them wherever ``torch.cuda.is_available()``; benchmarks/gpu/run_all.py runs
them on a lent GPU)."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
