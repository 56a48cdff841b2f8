"""The flat step's optimizer state, one truth in two shapes (mixprec.optim.flat): the twin's flat
state per chunk, and the inner optimizer's per-master state, which ``state_dict()`` saves.

After the chunks are made, a load, or a per-master step, a chunk *adopts* its masters' state (the
concatenation, once; :meth:`TwinState.adopt`); the twin then owns it and every master's state is
views of it (:meth:`TwinState.share`), so nothing is copied between the two and the checkpoint
format is unchanged. 8-bit moments stay per master (codes and scales): only the step counter is
shared. Before a per-master step :meth:`TwinState.unshare` gives each master its own counter back."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mixprec.optim.flat_chunk import Chunk

__all__ = ["TwinState"]


class TwinState:
    """The state of a :class:`mixprec.optim.flat.FlatSteps`' chunks between its ``twin`` and the
    ``inner`` optimizer. ``pool``: 8-bit packing buffers, one per device and block length (each
    chunk's moments cache points at it); ``moments``: the 8-bit format, or None."""

    def __init__(self, twin: torch.optim.Optimizer, inner: torch.optim.Optimizer, moments: str | None,
                 pool: dict) -> None:
        self.twin, self.inner, self.moments, self.pool = twin, inner, moments, pool

    def adopt(self, chunk: Chunk, inner_state: dict[Tensor, dict[str, Any]]) -> bool:
        """Make the twin's state of ``chunk`` the concatenation of its masters' state (after a
        load or a per-master step); False when they cannot share one (different step counts)."""
        sts = [inner_state.get(m) for m in chunk.masters]
        self.twin.state.pop(chunk.param, None)
        chunk.viewed = False
        chunk.cache = {"pool": self.pool}
        chunk.stored = None
        if self.moments:
            return self._adopt_coded(chunk, inner_state)
        if all(not st for st in sts):
            chunk.synced = True
            return True
        if any(not st for st in sts) or any(st.keys() != sts[0].keys() for st in sts):
            return False
        flat: dict[str, Any] = {}
        for key in sts[0]:
            vals = [st[key] for st in sts]
            if all(isinstance(v, Tensor) and v.shape == p.shape for v, p in zip(vals, chunk.models)) \
                    and key != "step":
                flat[key] = torch.cat([v.reshape(-1) for v in vals])
            elif all(isinstance(v, Tensor) and v.dim() == 0 for v in vals):
                if len({float(v) for v in vals}) != 1:       # a host read of CPU step counters
                    return False
                flat[key] = vals[0].clone()
            elif all(not isinstance(v, Tensor) and v == vals[0] for v in vals):
                flat[key] = vals[0]
            else:
                return False
        self.twin.state[chunk.param] = flat
        self.share(chunk, inner_state)
        chunk.synced = True
        return True

    def _adopt_coded(self, chunk: Chunk, inner_state: dict[Tensor, dict[str, Any]]) -> bool:
        """8-bit moments stay per master (codes and scales, or FP32 moments of vectors); only the
        step counter is shared: the twin's ``step`` with views of it in every master's state."""
        sts = [inner_state.get(m) for m in chunk.masters]
        if all(not st for st in sts):
            for i, m in enumerate(chunk.masters):
                inner_state[m] = self.inner.new_state(chunk.w_views[i])      # type: ignore[attr-defined]
            sts = [inner_state[m] for m in chunk.masters]
        if any(not st or "step" not in st for st in sts) or len({float(st["step"]) for st in sts}) != 1:
            return False
        step = sts[0]["step"].clone()
        self.twin.state[chunk.param] = {"step": step, **chunk.moments}
        for st in sts:
            st["step"] = step.view(())
        chunk.coded = [i for i, st in enumerate(sts) if "exp_avg_scale" in st]
        chunk.plain = [i for i, st in enumerate(sts) if "exp_avg_scale" not in st]
        chunk.viewed = chunk.synced = True
        return True

    def share(self, chunk: Chunk, inner_state: dict[Tensor, dict[str, Any]]) -> None:
        """Point every master's state at views of the twin's flat state of ``chunk`` (once)."""
        flat = self.twin.state.get(chunk.param)
        if not flat:
            return
        chunk.shared = {k: v for k, v in flat.items() if isinstance(v, Tensor)}
        for m, p, a, n in zip(chunk.masters, chunk.models, chunk.starts, chunk.numels):
            st = {}
            for key, v in flat.items():
                if isinstance(v, Tensor) and v.dim() == 1 and v.numel() == chunk.numel and key != "step":
                    st[key] = v[a:a + n].view(p.shape)
                elif isinstance(v, Tensor) and v.dim() == 0:
                    st[key] = v.view(())       # shared: one step counter for the chunk
                else:
                    st[key] = v
            inner_state[m] = st
        chunk.viewed = True

    def unshare(self, chunks: list[Chunk], inner_state: dict[Tensor, dict[str, Any]]) -> None:
        """Before a per-master step: give each master its own step counter (the views share one)
        and make every chunk adopt the per-master state again at its next flat step (the counters
        settled first: ``FlatSteps.unshare``)."""
        for chunk in chunks:
            if chunk.viewed:
                for m in chunk.masters:
                    st = inner_state.get(m)
                    if st:
                        inner_state[m] = {k: (v.clone() if isinstance(v, Tensor) and v.dim() == 0 else v)
                                          for k, v in st.items()}
            chunk.viewed = chunk.synced = False
