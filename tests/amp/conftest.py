"""Make ``amp_helpers`` importable (``--import-mode=importlib`` does not put test folders on
``sys.path``) and run these tiny-tensor tests on one intra-op thread (on the shared 2-core box a
second OpenMP thread only adds barrier waits)."""
import os
import sys

import pytest
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
