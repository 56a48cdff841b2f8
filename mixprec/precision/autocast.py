"""Run a region of code in the policy's compute dtype."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from mixprec.policy.policy import Policy, get_policy

__all__ = ["autocast"]


@contextlib.contextmanager
def autocast(policy: Policy | str | bool = True, *,
             device_type: str | None = None, enabled: bool = True) -> Iterator[Policy]:
    """Apply ``policy``'s compute dtype to matmuls/convolutions inside the block.

    A thin, explicit layer over :class:`torch.autocast`: BF16/FP16 compute dtypes turn autocast on
    for ``device_type`` (default: ``cuda`` when available, else ``cpu``); an FP32 compute dtype
    turns any enclosing autocast *off*, so FP32 means FP32. ``allow_tf32`` policies enable TF32
    matmuls for the duration of the block and restore the previous setting after it.
    Yields the resolved policy.
    """
    policy = get_policy(policy)
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    tf32_before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    if policy.allow_tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    try:
        with torch.autocast(device_type=device_type, dtype=policy.compute_dtype
                            if policy.is_mixed else torch.bfloat16,
                            enabled=enabled and policy.is_mixed):
            yield policy
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32_before
