"""Optimizer state next to FSDP2's DTensor shards: the local view, and state shaped like a shard.

FSDP2 turns every parameter into a ``DTensor`` sharded along dim 0 (``Shard(0)`` on a 1-D mesh).
mixprec's FP32-math AdamW (mixprec.optim.adamw) updates each rank's local shard elementwise, and
keeps its 8-bit moments (mixprec.optim.moments) as DTensors of the parameter's mesh and placement:
the codes have the parameter's shape, the block scales ``(rows, blocks per row)``, both sharded
along dim 0 into the same rows. FP8 codes are kept as their bytes (``uint8``) in the DTensor, since
gloo cannot gather or broadcast an FP8 tensor; the optimizer views them as FP8 to use them, and
mixprec.strategies.fsdp turns the gathered bytes back into FP8 codes, so a checkpoint is the same
at every world size. ``torch.distributed.checkpoint.state_dict`` then gathers them into
full tensors for a checkpoint and cuts them again for any world size, exactly as it does the
parameter, so 8-bit moments reshard bit for bit.

``import mixprec`` does not load DTensor: a tensor is a DTensor only if that module is loaded.
"""
from __future__ import annotations

import sys

import torch
from torch import Tensor

from mixprec.errors import ConfigError

__all__ = ["is_dtensor", "local", "like"]


def is_dtensor(t: object) -> bool:
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def local(t: Tensor) -> Tensor:
    """The rank's own part of ``t`` (a DTensor's local shard, the same storage), else ``t``."""
    return t.to_local() if is_dtensor(t) else t


def like(p: Tensor, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` (tensors made for ``p``'s local shard, dim 0 = the shard's rows) as DTensors of
    ``p``'s mesh and placement; unchanged when ``p`` is a plain tensor. Refused in one line for a
    placement other than dim-0 sharding or replication (a tensor-parallel dim-1 shard would cut
    the blocks)."""
    if not is_dtensor(p):
        return state
    from torch.distributed.tensor import DTensor, Replicate, Shard
    for pl in p.placements:
        if not (isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0)):
            raise ConfigError(f"8-bit moments shard along dim 0 with the parameter; a parameter placed "
                              f"{tuple(p.placements)} is not supported (use moments=fp32 or bf16)")
    mesh = p.device_mesh
    rows = p.shape[0]
    out = {}
    for key, t in state.items():
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            t = t.view(torch.uint8)          # gloo has no FP8 type: the shard keeps the codes' bytes
        shape = torch.Size((rows, *t.shape[1:]))
        stride = torch.empty(0).new_empty(shape, device="meta").stride()
        out[key] = DTensor.from_local(t, mesh, p.placements, run_check=False, shape=shape, stride=stride)
    return out
