import pytest
import torch


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """Run these tiny-tensor tests on one intra-op thread.

    On the shared 2-core CI box a second OpenMP thread is often descheduled, and then even a
    4096-element ``sqrt`` waits ~28 ms at the parallel region's barrier (measured: 0.006 ms on one
    thread). The optimizer math is the same either way; only the wall time changes.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
