"""8-bit moments around a chunk's update (mixprec.optim.flat): the masters' codes and scales (or
the FP32 moments of vectors, which 8-bit moments leave unquantised) stay per master, in the inner
optimizer's state; each step decodes them into the chunk's FP32 moment scratch before the update
(the twin's step or the kernel, which see FP32 moments) and encodes them back after it, with the
inner optimizer's rounding noise drawn in the order of its own per-master step
(mixprec.optim.moments)."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mixprec.optim import moments as _moments
from mixprec.optim.flat_chunk import Chunk

__all__ = ["CodedMoments"]


class CodedMoments:
    """Decode and encode the 8-bit moments (format ``moments``: "int8", "fp8", ...) of the
    ``inner`` optimizer's masters around each chunk's update."""

    def __init__(self, inner: torch.optim.Optimizer, moments: str) -> None:
        self.inner, self.moments = inner, moments

    def _coded_lists(self, chunk: Chunk, inner_state: dict[Tensor, dict[str, Any]]):
        sts = [inner_state[chunk.masters[i]] for i in chunk.coded]
        plain = [inner_state[chunk.masters[i]] for i in chunk.plain]
        return sts, plain

    def decode(self, chunk: Chunk, inner_state: dict[Tensor, dict[str, Any]]) -> None:
        """The masters' 8-bit (or FP32 vector) moments into the chunk's FP32 moment scratch."""
        sts, plain = self._coded_lists(chunk, inner_state)
        for key, views in (("exp_avg", chunk.m_views), ("exp_avg_sq", chunk.v_views)):
            if sts:
                _moments.decode_(sts, key, [views[i] for i in chunk.coded], self.moments, cache=chunk.cache)
            if plain:
                torch._foreach_copy_([views[i] for i in chunk.plain], [st[key] for st in plain])

    def encode(self, chunk: Chunk, inner_state: dict[Tensor, dict[str, Any]]) -> None:
        """The updated FP32 moments back into the masters' codes (the inner optimizer's rounding
        noise, drawn in the order of its own per-master step) and FP32 vector moments."""
        sts, plain = self._coded_lists(chunk, inner_state)
        gen = self.inner._generator(chunk.param.device)           # type: ignore[attr-defined]
        for key, views in (("exp_avg", chunk.m_views), ("exp_avg_sq", chunk.v_views)):
            if sts:
                _moments.encode_(sts, key, [views[i] for i in chunk.coded], self.moments, gen, cache=chunk.cache)
        for key, views in (("exp_avg", chunk.m_views), ("exp_avg_sq", chunk.v_views)):
            if plain:
                torch._foreach_copy_([st[key] for st in plain], [views[i] for i in chunk.plain])
