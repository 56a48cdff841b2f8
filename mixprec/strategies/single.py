"""One process, one device: the strategy of a laptop, a CPU box or a single GPU.

Everything the base :class:`~mixprec.strategies.base.Strategy` does by default is already right
for one device; this class only chooses the device (the current CUDA device when there is one,
otherwise the CPU) and refuses a launch that asked for more than one process, where silently
training the same model ``WORLD_SIZE`` times would waste the cluster.
"""
from __future__ import annotations

import torch

from mixprec.errors import ConfigError
from mixprec.precision import default_device
from mixprec.strategies.base import Strategy
from mixprec.strategies.env import read_env

__all__ = ["SingleDeviceStrategy"]


class SingleDeviceStrategy(Strategy):
    """Train on one device; ``device=None`` picks CUDA if available, else the CPU."""

    name = "single"

    def __init__(self, device: torch.device | str | None = None) -> None:
        env = read_env()
        if env.distributed:
            raise ConfigError(f"SingleDeviceStrategy in a job of WORLD_SIZE={env.world_size} "
                              "processes would train independent copies; use MirroredStrategy() "
                              "or FSDPStrategy(), or strategy='auto'")
        super().__init__(device=torch.device(device) if device is not None else default_device())
