"""Saving and loading :class:`mixprec.optim.MasterWeights`: its checkpoint half.

A mixin, as :class:`mixprec.optim.split.SplitSteps` is: it reads the wrapper's bookkeeping
(``_inner``, ``_all_model_params``, ``_model_params``/``_masters``, ``_master_of``, the split
remainders ``_lo``/``_ties``). The state dict is the inner optimizer's plus the FP32 masters by
flat parameter index under :data:`STATE_KEY`; split masters are joined into FP32 tensors, so the
file is the same with and without them, and it loads with ``torch.load(..., weights_only=True)``.
"""
from __future__ import annotations

from typing import Any

import torch

from mixprec.errors import CheckpointError
from mixprec.optim import split as _split

__all__ = ["MasterState", "STATE_KEY"]

STATE_KEY = "master_weights"
"""Where a ``MasterWeights`` state dict keeps its masters."""


class MasterState:
    """``state_dict`` / ``load_state_dict`` / ``sync_masters_from_model`` of ``MasterWeights``."""

    @torch.no_grad()
    def sync_masters_from_model(self) -> None:
        """Overwrite the masters with the model params (after loading model weights only)."""
        self._drop_flat()        # the tie lists below are the truth again (mixprec.optim.flat)
        full = [(m, p) for p, m in zip(self._model_params, self._masters) if not self._is_split(m)]
        if full:
            torch._foreach_copy_([m for m, _ in full], [p for _, p in full])
        for m in self._masters:
            if self._is_split(m):
                self._lo[id(m)].zero_()
                self._ties[id(m)] = _split.empty_ties(m.device)

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus the masters (by flat param index), in FP32.

        Like torch's, the returned tensors are references, not copies (split masters are joined
        into fresh FP32 tensors, so the file is the same with and without split masters). Everything
        in it loads with ``torch.load(..., weights_only=True)``.
        """
        sd = self._inner.state_dict()
        # The flat step's per-master state views share one step counter per chunk
        # (mixprec.optim.flat): save each its own, as torch's optimizers do.
        sd["state"] = {i: {k: (v.clone() if isinstance(v, torch.Tensor) and v.dim() == 0 else v)
                           for k, v in st.items()} for i, st in sd["state"].items()}
        index = {id(p): i for i, p in enumerate(self._all_model_params)}
        sd[STATE_KEY] = {
            "dtype": str(self.master_dtype).removeprefix("torch."),
            "index": [index[id(p)] for p in self._model_params],
            "tensors": self.masters,
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the inner state and the masters, and round the masters into the model params.

        A plain torch optimizer state dict (no masters in it) also loads: the masters are then
        left as they are (call ``sync_masters_from_model()`` after loading the model weights).
        """
        sd = dict(state_dict)
        saved = sd.pop(STATE_KEY, None)
        self.zero_grad()
        self._drop_flat()        # new state and masters: the chunks adopt them at the next step
        try:
            self._inner.load_state_dict(sd)
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"optimizer state does not match this optimizer ({exc}); load it into "
                                  "an optimizer built over the same parameters in the same order") from None
        self._alias_inner()
        self._grads_ready = False
        if saved is None:
            return
        n = len(self._all_model_params)
        tensors, index = saved["tensors"], saved["index"]
        if len(tensors) != len(index) or any(not 0 <= i < n for i in index):
            raise CheckpointError("the saved master weights index params this optimizer does not have; "
                                  "load the checkpoint into an optimizer over the same model")
        dst_masters, src, model_params = [], [], []
        with torch.no_grad():
            for i, t in zip(index, tensors):
                p = self._all_model_params[i]
                if t.shape != p.shape:
                    raise CheckpointError(f"saved master #{i} has shape {tuple(t.shape)} but the param has "
                                          f"{tuple(p.shape)}; load the checkpoint into the same model architecture")
                m = self._master_of[id(p)]
                if self._is_split(m):
                    w = t.to(device=p.device, dtype=torch.float32, copy=True)
                    self._ties[id(m)] = _split.split_(w, p.data, self._lo[id(m)])
                    continue
                dst_masters.append(m)
                src.append(t)
                if m is not p:
                    model_params.append(p)
            if not dst_masters:
                return
            torch._foreach_copy_(dst_masters, src)
            if model_params:
                torch._foreach_copy_(model_params, [self._master_of[id(p)] for p in model_params])
