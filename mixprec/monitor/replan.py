"""Re-planning while training: move an FP8 layer to a higher precision when its inputs stop fitting
FP8, and back to its planned format once they fit again.

:class:`LayerReplanner` watches every Linear whose *planned* format (the formats
:meth:`mixprec.Precision.setup` resolved) is FP8. On sampled steps (every ``every`` steps; hooks
exist only then) it measures each such layer's input the way its planned recipe would quantize it:

* ``underflow``  the share of non-zero input values that the recipe's scaling flushes to zero
                 (``|x| / scale <= smallest_subnormal / 2`` of the forward FP8 format: values an
                 outlier pushed out of range; with current scaling nothing saturates, so this is
                 the failure that grows with outliers),
* ``amax``       the input's largest magnitude, compared with the previous sample (growth),
* ``grad underflow``  the same flush share for the gradient arriving at the layer's output,
                 quantized as the recipe quantizes it for the input-gradient GEMM (its gradient
                 format, tiles along the output features).

Decision after each sampled step, per layer (a pure function of the measurements and the state):

* in FP8 and (``underflow > max_underflow``, ``grad underflow > max_underflow`` or
  ``amax > max_amax_growth * previous amax``):
  switch to ``fallback`` (the mode's non-FP8 compute format, e.g. ``bf16``) at once;
* promoted and healthy on ``window`` consecutive samples: switch back to the planned format.

A switch swaps the module only (:meth:`mixprec.Precision.layers.set_format`): parameters, FP32
masters and optimizer state are the same tensors before and after. The trainer writes each switch
to ``events.jsonl`` (``"kind": "format"``) and the terminal, and saves the current formats and
this object's state in checkpoints. One host sync per sampled step; under ``torch.distributed``
the measurements are reduced (MAX) across ranks first, so all ranks switch alike.

Not measured (yet): FP8 saturation under delayed scaling (the measurement uses current scaling).
Flush shares, not SQNR, are the signal: an outlier dominates a tensor's energy, so the SQNR of a
tensor with outliers stays high while everything but the outliers is lost. The numerics
monitor's own rows are not read (it checks outputs against one format, this checks each FP8
layer's operands against its recipe).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from mixprec.errors import ConfigError
from mixprec.formats import Fp8Config, MicroConfig, quantize_operand
from mixprec.formats.fp8_linear import _operand_block
from mixprec.formats.fp8_quantize import quantize
from mixprec.formats.mx import lost_share
from mixprec.policy.dtypes import format_info
from mixprec.policy.overrides import format_dtype, is_micro
from mixprec.precision import Precision

__all__ = ["LayerReplanner", "FormatSwitch", "flushed_share"]


def flushed_share(t: torch.Tensor, fmt: str, kind: str = "act") -> torch.Tensor:
    """The share of ``t``'s non-zero values that format ``fmt`` flushes to zero or saturates
    (a 0-d tensor on ``t``'s device, no host sync).

    FP8 recipes: ``t`` quantized as the recipe quantizes it for a GEMM operand (``kind="act"``:
    the forward format; ``kind="grad"``: the gradient format; the recipe's tiles along the last
    dimension); with current scaling nothing saturates, so this counts what the scale pushed
    below half the smallest subnormal. ``bf16``/``fp16``/``fp32``: values below half the format's
    smallest subnormal or above its largest finite value. Micro formats (``mxfp8``, ``mxfp4``,
    ``nvfp4``): quantized as their GEMM operand, values flushed to zero or clamped."""
    t = t.detach().reshape(-1, t.shape[-1]).float()
    nonzero = (t != 0).sum().clamp(min=1)
    if fmt.startswith("fp8-"):
        config = Fp8Config.from_recipe(fmt)
        dtype = config.forward_dtype if kind == "act" else config.grad_dtype
        q = quantize(t, dtype, _operand_block(config, "act"), margin=config.margin,
                     power_of_two=config.power_of_two_scales)
        return ((q.data.float() == 0) & (t != 0)).sum() / nonzero
    if is_micro(fmt):                   # block-scaled: flushed to zero or clamped by its block scale
        return lost_share(t, quantize_operand(t, MicroConfig.from_recipe(fmt), grad=kind == "grad"))
    dtype = format_dtype(fmt)
    if dtype is None:                   # a format this function does not model
        return torch.zeros((), device=t.device)
    info = format_info(dtype)
    a = t.abs()
    lost = ((a < info.smallest_subnormal / 2) & (a != 0)) | (a > info.max)
    return lost.sum() / nonzero


@dataclass(frozen=True)
class FormatSwitch:
    """One layer changing format at ``step``."""

    step: int
    module: str
    old: str
    new: str
    reason: str

    @property
    def message(self) -> str:
        return f"step {self.step}: {self.module} {self.old} -> {self.new} ({self.reason})"

    def to_dict(self) -> dict:
        return {"kind": "format", "step": self.step, "module": self.module, "from": self.old,
                "to": self.new, "reason": self.reason, "message": self.message}


class LayerReplanner:
    """See the module docstring."""

    def __init__(self, precision: Precision, model: nn.Module, *, every: int, window: int = 3,
                 max_underflow: float = 0.01, max_amax_growth: float = 16.0,
                 fallback: str | None = None) -> None:
        if every < 1 or window < 1:
            raise ConfigError(f"replan_every ({every}) and replan_window ({window}) must be >= 1")
        if not precision.layers.formats:
            raise ConfigError("re-planning needs a model set up by the Precision (call setup first)")
        self.precision = precision
        self.every, self.window = every, window
        self.max_underflow, self.max_amax_growth = max_underflow, max_amax_growth
        self.fallback = fallback or precision.recipe.base_format
        if self.fallback.startswith("fp8-"):
            raise ConfigError(f"the re-planning fallback must be fp32, bf16 or fp16, not {self.fallback}")
        self.planned = {n: f for n, f in precision.layers.formats.items() if f.startswith("fp8-")}
        self.healthy: dict[str, int] = {n: 0 for n in self.planned}
        self.last_amax: dict[str, float] = {}
        self._stats: dict[str, list[torch.Tensor]] | None = None
        self.last_measured: dict[str, tuple[float, float]] = {}
        """name -> (input underflow, input amax, gradient underflow) of the last sampled step."""

    def should_sample(self, step: int) -> bool:
        return bool(self.planned) and step % self.every == 0

    @contextlib.contextmanager
    def sample(self, model: nn.Module, step: int) -> Iterator[None]:
        """Measure the watched layers' inputs during this step if it is a sampled one."""
        if not self.should_sample(step):
            yield
            return
        self._stats = {n: [] for n in self.planned}
        handles = [model.get_submodule(name).register_forward_hook(self._hook(name))
                   for name in self.planned]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _hook(self, name: str):
        fmt = self.planned[name]

        def hook(module: nn.Module, args, output) -> None:
            x = args[0]
            rec = [flushed_share(x, fmt, "act"), x.detach().abs().amax().float(),
                   torch.zeros((), device=x.device)]
            self._stats[name].append(rec)
            if isinstance(output, torch.Tensor) and output.requires_grad:
                def on_grad(g: torch.Tensor) -> None:
                    rec[2] = flushed_share(g, fmt, "grad")
                output.register_hook(on_grad)
        return hook

    def decide(self, model: nn.Module, step: int) -> list[FormatSwitch]:
        """After a sampled step: switch layers as the module docstring says; return the switches."""
        if self._stats is None:
            return []
        stats, self._stats = self._stats, None
        names = [n for n in self.planned if stats[n]]
        if not names:
            return []
        # One host sync: every layer's (underflow, amax, grad underflow), the max over micro-batches and, under
        # torch.distributed, over ranks, so that every rank makes the same switches.
        values = torch.stack([torch.stack([torch.stack(r) for r in stats[n]]).amax(0) for n in names])
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        values = values.tolist()
        switches = []
        for name, (underflow, amax, grad_underflow) in zip(names, values):
            self.last_measured[name] = (underflow, amax, grad_underflow)
            previous = self.last_amax.get(name)
            self.last_amax[name] = amax
            reasons = []
            if not underflow <= self.max_underflow:          # NaN counts as bad
                reasons.append(f"{100 * underflow:.1f}% of its inputs flush to zero in "
                               f"{self.planned[name]} (limit {100 * self.max_underflow:g}%)")
            if not grad_underflow <= self.max_underflow:
                reasons.append(f"{100 * grad_underflow:.1f}% of its output gradient flushes to zero "
                               f"in {self.planned[name]} (limit {100 * self.max_underflow:g}%)")
            if previous and amax > self.max_amax_growth * previous:
                reasons.append(f"input amax grew {amax / previous:.0f}x since step {step - self.every}")
            current = self.precision.layers.formats[name]
            if reasons and current.startswith("fp8-"):
                new = self.precision.layers.set_format(model, name, self.fallback)
                self.healthy[name] = 0
                switches.append(FormatSwitch(step, name, current, new, "; ".join(reasons)))
            elif reasons:
                self.healthy[name] = 0
            elif current != self.planned[name]:
                self.healthy[name] += 1
                if self.healthy[name] >= self.window:
                    new = self.precision.layers.set_format(model, name, self.planned[name])
                    self.healthy[name] = 0
                    switches.append(FormatSwitch(step, name, current, new,
                                                 f"inputs fit {self.planned[name]} again on "
                                                 f"{self.window} sampled steps"))
        return switches

    def state_dict(self) -> dict:
        return {"planned": dict(self.planned), "healthy": dict(self.healthy),
                "last_amax": dict(self.last_amax)}

    def load_state_dict(self, state: dict) -> None:
        if dict(state.get("planned", {})) != self.planned:
            raise ConfigError("the checkpoint's re-planning state belongs to another plan; resume "
                              "with the precision it was trained with")
        self.healthy.update(state.get("healthy", {}))
        self.last_amax.update(state.get("last_amax", {}))
