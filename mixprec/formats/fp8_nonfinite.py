"""Non-finite FP8 operands, seen on the device and read once per step.

An FP8 cast never checks its input with a host read: an inf/NaN makes the amax, hence the scale,
of its block non-finite (see :mod:`mixprec.formats.fp8_cast`). Each FP8 layer keeps one FP32
device tensor, ``fp8_scale_max``, into which every one of its casts folds its scales
(``max``, NaN-sticky): finite while every operand was finite, inf or NaN from the first
non-finite operand on. Nothing is synchronised per cast. The step does not need these flags to
skip: the non-finite scale makes the outputs (forward) or gradients (backward) computed from the
block NaN, and the step's own gradient check sees that (tests/formats/test_fp8_step_skip.py).
They say *which* layer, for a hand loop or a report:

* :func:`found_nonfinite(model) <found_nonfinite>` -- a 0-dim bool *device* tensor, a handful of
  ops whatever the number of layers (fold it into a ``found_inf`` of your own, no sync) -- and
  then :func:`reset_nonfinite` (one ``_foreach_zero_``) for the next step;
* :func:`nonfinite_layers` -- the names of the layers whose operands were not finite, one host
  read, for an error message or a report once the step knows it skipped.

The flags are plain tensor attributes, not buffers: not in ``state_dict`` (checkpoints stay
interchangeable with plain ``nn.Linear`` models), not broadcast by DDP (each rank's flag is its
own; the step reduces ``found_inf`` across ranks as it does for gradients).
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["TracksNonFinite", "found_nonfinite", "reset_nonfinite", "nonfinite_layers", "FLAG"]

FLAG = "fp8_scale_max"
"""Name of the per-layer buffer."""


class TracksNonFinite:
    """Mixin of the FP8 layers: holds the ``fp8_scale_max`` flag, a (1, 1) FP32 device tensor.

    A plain attribute, not a buffer: DDP broadcasts buffers from rank 0 at every forward, which
    would overwrite the flag a rank set in its backward; ``state_dict`` never carries it. The
    layer moves it with its weights (``_apply``): a new device starts from zero."""

    def _init_nonfinite_flag(self, device: torch.device | str | None) -> None:
        object.__setattr__(self, FLAG, torch.zeros(1, 1, dtype=torch.float32, device=device))

    def _move_nonfinite_flag(self, fn) -> None:
        """Called from the layer's ``_apply`` with its function (``.to``, ``.cuda``, ``to_empty``)."""
        flag = getattr(self, FLAG)
        moved = fn(flag)
        if moved.device != flag.device:
            self._init_nonfinite_flag(moved.device)


def _flags(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, getattr(m, FLAG)) for name, m in model.named_modules()
            if isinstance(m, TracksNonFinite) and getattr(m, FLAG).device.type != "meta"]


def found_nonfinite(model: nn.Module, *, reset: bool = False) -> torch.Tensor:
    """0-dim bool tensor on the first flag's device: some FP8 cast in ``model`` saw inf or NaN
    since the last reset. No host sync; False (CPU) for a model without FP8 layers. Fold it into
    the step's ``found_inf`` (``found_inf |= found_nonfinite(model, reset=True)``); ``reset``
    zeroes the flags after reading them (stream-ordered: the result is taken first)."""
    flags = [f for _, f in _flags(model)]
    if not flags:
        return torch.zeros((), dtype=torch.bool)
    top = _stack(flags).amax()
    found = (top - top).ne(0)                  # inf - inf and NaN - NaN are NaN; x - x is 0
    if reset:
        torch._foreach_zero_(flags)
    return found


def _stack(flags: list[torch.Tensor]) -> torch.Tensor:
    dev = flags[0].device
    return torch.stack([f if f.device == dev else f.to(dev, non_blocking=True) for f in flags])


def reset_nonfinite(model: nn.Module) -> None:
    """Zero every FP8 layer's flag (one ``_foreach_zero_``); call it once per optimizer step."""
    flags = [f for _, f in _flags(model)]
    if flags:
        torch._foreach_zero_(flags)


def nonfinite_layers(model: nn.Module) -> list[str]:
    """Qualified names of the FP8 layers whose operands held inf/NaN since the last reset. One
    host read (for messages and reports at a skipped step, not for every step)."""
    named = _flags(model)
    if not named:
        return []
    bad = (~torch.isfinite(_stack([f for _, f in named]).reshape(-1))).tolist()  # the one read
    return [name for (name, _), b in zip(named, bad) if b]
