"""Per-layer range statistics: how close each layer's values come to the edges of a format.

``NumericsMonitor(model, every=100)`` measures, on sampled steps only, for each chosen module:

* ``act``    its forward output,
* ``grad``   the gradient w.r.t. that output as backward computes it (so *including* the loss
             scale: a scaled gradient is what an FP16 backward actually holds, and what
             overflows); the row's ``loss_scale`` is that scale, so ``absmax / loss_scale`` is the
             gradient itself (the report's heat map shows that),
* ``update`` the change of its own parameters over one optimizer step,

and reports, per (step, module, kind), a :class:`NumericsRow` with the columns of ``numerics.csv``
(docs/CONTRACTS.md) plus ``subnormal_frac``:

* ``absmax``          largest |x| (NaN/inf propagate: they *are* the news),
* ``overflow_frac``   share of values at or beyond the round-to-nearest overflow boundary of the
                      check dtype (``max + ulp(max)/2``; 65520 for FP16, 464 for E4M3) or already
                      non-finite. Thresholds, not a cast: PyTorch's E4M3 cast *saturates* to 448,
                      which would hide exactly the values we want to count;
* ``underflow_frac``  share of non-zero values that round to zero (``0 < |x| <= smallest_subnormal/2``);
* ``subnormal_frac``  share that land in the subnormal range (kept, with fewer significant bits;
                      flushed to zero by hardware running in flush-to-zero mode).

For ``update`` rows ``underflow_frac`` is the share of elements whose update is at most half an ULP
of the parameter in its storage dtype — an update that rounds away entirely when applied to the
stored value (exactly the loss FP32 master weights prevent). ``overflow_frac`` counts non-finite
updates; ``subnormal_frac`` is not measured (empty).

Cost model: off sampled steps no hook exists at all. On a sampled step each observed tensor costs a
few elementwise kernels and yields a 4-vector kept on the device; :meth:`Sample.finish` stacks them
and moves them to the host with one transfer: one host sync per sampled step (per device).
"""
from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from mixprec.errors import ConfigError
from mixprec.precision import Precision
from mixprec.policy.dtypes import dtype_name, format_info, parse_dtype
from mixprec.policy.policy import Policy

__all__ = ["NumericsRow", "NUMERICS_COLUMNS", "NumericsMonitor", "Sample", "range_counts", "ulp",
           "update_counts"]

NUMERICS_COLUMNS: tuple[str, ...] = ("step", "module", "kind", "absmax", "overflow_frac",
                                     "underflow_frac", "dtype", "subnormal_frac", "loss_scale")
"""``numerics.csv`` columns: the contract's seven, then ``subnormal_frac`` and ``loss_scale`` appended."""


@dataclass(frozen=True, kw_only=True)
class NumericsRow:
    """One line of ``numerics.csv``."""

    step: int
    module: str
    kind: str
    """``act``, ``grad`` or ``update``."""
    absmax: float
    overflow_frac: float
    underflow_frac: float
    dtype: str
    """The dtype whose range was checked: the compute (or grad) dtype, or the storage dtype for updates."""
    subnormal_frac: float | None = None
    loss_scale: float | None = None
    """``grad`` rows: the loss scale the measured gradients carry (``absmax / loss_scale`` is the
    gradient's own largest magnitude); None for ``act`` and ``update`` rows, and where the step's
    scale is not known (a monitor given no :class:`~mixprec.Precision` nor ``loss_scale=``)."""

    def to_dict(self) -> dict:
        return asdict(self)


# --- pure measurements (device tensors in, device tensors out, no sync) --------------------------

@functools.cache
def _thresholds(dtype: torch.dtype) -> tuple[float, float, float]:
    """(overflow_at, flush_at_or_below, subnormal_below) under round-to-nearest-even."""
    fi = format_info(dtype)
    top_ulp = 2.0 ** (math.floor(math.log2(fi.max)) - fi.mantissa_bits)
    return fi.max + top_ulp / 2, fi.smallest_subnormal / 2, fi.tiny - fi.smallest_subnormal / 2


def range_counts(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(4,) float32 on x's device: [absmax, #overflow, #flush-to-zero, #subnormal] of ``x`` in ``dtype``."""
    over_at, flush_at, sub_below = _thresholds(dtype)
    a = x.detach().abs().float()
    nonzero = a > 0
    over = (a >= over_at) | ~torch.isfinite(a)
    flush = nonzero & (a <= flush_at)
    sub = (a > flush_at) & (a < sub_below)
    amax = a.amax() if a.numel() else a.new_zeros(())
    return torch.stack([amax, over.sum().float(), flush.sum().float(), sub.sum().float()])


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at each value of ``x`` (as float32): ``2**(floor(log2|x|) - m)``,
    and the smallest subnormal below the smallest normal."""
    fi = format_info(dtype)
    a = x.detach().float().abs()
    _, exp = torch.frexp(a)  # a = mant * 2**exp, mant in [0.5, 1)
    spacing = torch.ldexp(torch.ones_like(a), exp - 1 - fi.mantissa_bits)
    return torch.where(a < fi.tiny, torch.full_like(a, fi.smallest_subnormal), spacing)


def update_counts(before: torch.Tensor, after: torch.Tensor, storage_dtype: torch.dtype) -> torch.Tensor:
    """(4,) float32: [max |update|, #non-finite updates, #updates <= ulp/2 in storage dtype, #changed]."""
    d = (after.detach().float() - before.detach().float()).abs()
    lost = d <= ulp(before, storage_dtype) / 2
    amax = d.amax() if d.numel() else d.new_zeros(())
    return torch.stack([amax, (~torch.isfinite(d)).sum().float(), lost.sum().float(),
                        (d != 0).sum().float()])


# --- the monitor ----------------------------------------------------------------------------------

def _default_filter(module: nn.Module, fqn: str) -> bool:
    """Leaf modules that own parameters: Linear, norms, embeddings, convolutions."""
    return next(module.children(), None) is None and next(module.parameters(recurse=False), None) is not None


@dataclass
class Sample:
    """What one sampled step collects; ``rows`` is filled when its ``sample()`` block exits."""

    step: int
    active: bool
    loss_scale: float | None = None
    """The loss scale of this step's backward (set on ``grad`` rows)."""
    rows: list[NumericsRow] = field(default_factory=list)
    _keys: list[tuple[str, str, str, int]] = field(default_factory=list)  # module, kind, dtype, numel
    _vals: list[torch.Tensor] = field(default_factory=list)

    def add(self, module: str, kind: str, dtype: torch.dtype, numel: int, counts: torch.Tensor) -> None:
        self._keys.append((module, kind, dtype_name(dtype), numel))
        self._vals.append(counts)

    def finish(self) -> list[NumericsRow]:
        """Resolve everything collected with one host transfer per device; aggregate per (module, kind)."""
        table: list[list[float]] = [[]] * len(self._vals)
        by_device: dict[torch.device, list[int]] = {}
        for i, v in enumerate(self._vals):
            by_device.setdefault(v.device, []).append(i)
        for idx in by_device.values():
            for i, row in zip(idx, torch.stack([self._vals[i] for i in idx]).tolist()):  # the sync
                table[i] = row
        agg: dict[tuple[str, str], list] = {}
        for (module, kind, dt, numel), (amax, c1, c2, c3) in zip(self._keys, table):
            a = agg.setdefault((module, kind), [dt, 0.0, 0.0, 0.0, 0.0, 0])
            a[1] = amax if math.isnan(amax) or amax > a[1] else a[1]
            a[2] += c1
            a[3] += c2
            a[4] += c3
            a[5] += numel
        if any(k == "update" for _, k in agg) and \
                sum(a[4] for (_, k), a in agg.items() if k == "update") == 0:
            # no monitored parameter changed at all: the optimizer step was skipped
            agg = {key: a for key, a in agg.items() if key[1] != "update"}
        self.rows = [
            NumericsRow(step=self.step, module=module, kind=kind, absmax=a[1],
                        overflow_frac=a[2] / max(a[5], 1), underflow_frac=a[3] / max(a[5], 1),
                        dtype=a[0], subnormal_frac=None if kind == "update" else a[4] / max(a[5], 1),
                        loss_scale=self.loss_scale if kind == "grad" else None)
            for (module, kind), a in agg.items()]
        self._keys, self._vals = [], []
        return self.rows


class NumericsMonitor:
    """Per-layer activation / gradient / update range statistics on every ``every``-th step.

    ``compute_dtype`` is the format the ranges are checked against: a dtype or its name (``fp16``,
    ``bf16``, ``e4m3``, ``e5m2``), or a :class:`~mixprec.Precision` / :class:`~mixprec.Policy`: then each
    module is checked against the format it runs in, read from the per-layer table
    (``Precision.layers.range_formats``: an FP8 layer's activations against E4M3, gradients against E5M2;
    a layer overridden to FP32 against FP32). ``grad_dtype`` overrides the
    gradient format. ``module_filter_fn(module, fqn) -> bool`` picks the modules (default: leaf
    modules that own parameters)::

        monitor = NumericsMonitor(model, every=100, compute_dtype="fp16")
        with monitor.sample(step) as s:          # attaches hooks only if step % 100 == 0
            loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            with monitor.track_updates():        # snapshots params only on sampled steps
                scaler.step(optimizer)
        writer.writerows(r.to_dict() for r in s.rows)
    """

    def __init__(self, model: nn.Module, *, every: int = 100,
                 compute_dtype: torch.dtype | str | Policy | Precision = torch.float16,
                 grad_dtype: torch.dtype | str | None = None,
                 module_filter_fn: Callable[[nn.Module, str], bool] | None = None) -> None:
        if not isinstance(every, int) or every < 1:
            raise ConfigError(f"NumericsMonitor every={every!r} must be a positive integer (steps between samples)")
        per_layer: dict[str, tuple[torch.dtype, torch.dtype]] = {}
        self._precision = compute_dtype if isinstance(compute_dtype, Precision) else None
        try:
            act = grad = parse_dtype(compute_dtype)  # type: ignore[arg-type]
        except (ConfigError, AttributeError):
            # A Precision, a Policy or a policy name ("16-mixed", "p=f32,c=bf16"): each layer is
            # checked against the format it runs in, from the per-layer table (FP8 layers:
            # activations against E4M3, gradients against E5M2; per-layer overrides included).
            precision = compute_dtype if isinstance(compute_dtype, Precision) else Precision(compute_dtype)
            act, grad = precision.recipe.activation_format, precision.recipe.gradient_format
            per_layer = precision.layers.range_formats(model)
        self.act_dtype: torch.dtype = act
        self.grad_dtype: torch.dtype = parse_dtype(grad_dtype) if grad_dtype is not None else grad
        format_info(self.act_dtype), format_info(self.grad_dtype)  # validate: floating formats only
        self.every = every
        filt = module_filter_fn or _default_filter
        self.modules: dict[str, nn.Module] = {n: m for n, m in model.named_modules() if filt(m, n)}
        g_fixed = grad_dtype is not None
        self.formats: dict[str, tuple[torch.dtype, torch.dtype]] = {
            n: (per_layer.get(n, (act, grad))[0], self.grad_dtype if g_fixed else per_layer.get(n, (act, grad))[1])
            for n in self.modules}
        """Per monitored module: the (activation, gradient) formats its ranges are checked against."""
        self._current: Sample | None = None
        self.last_rows: list[NumericsRow] = []

    def should_sample(self, step: int) -> bool:
        return step % self.every == 0

    @contextlib.contextmanager
    def sample(self, step: int, *, loss_scale: float | None = None) -> Iterator[Sample]:
        """Collect statistics for this step if it is a sampled one; hooks live only inside the block.

        ``loss_scale``: the scale this step's backward multiplies the loss by (with a
        ``GradScaler``: ``scaler.get_scale()``), recorded on the ``grad`` rows; default: the
        current scale of the :class:`~mixprec.Precision` the monitor was given, when it scales."""
        s = Sample(step=step, active=self.should_sample(step))
        if not s.active:
            yield s
            return
        if loss_scale is None and self._precision is not None and self._precision.recipe.scales_loss:
            loss_scale = self._precision.scaler.get_scale()   # the scale the coming backward multiplies by
        s.loss_scale = None if loss_scale is None else float(loss_scale)
        handles = [m.register_forward_hook(self._make_hook(name, s)) for name, m in self.modules.items()]
        self._current = s
        ok = False
        try:
            yield s
            ok = True
        finally:
            for h in handles:
                h.remove()
            self._current = None
        if ok:
            self.last_rows = s.finish()

    def _make_hook(self, name: str, s: Sample):
        act_dt, grad_dt = self.formats[name]

        def on_grad(g: torch.Tensor) -> None:
            s.add(name, "grad", grad_dt, g.numel(), range_counts(g, grad_dt))

        def hook(module: nn.Module, args, output) -> None:
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    s.add(name, "act", act_dt, t.numel(), range_counts(t, act_dt))
                    if t.requires_grad:
                        t.register_hook(on_grad)
        return hook

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of the monitored modules' own parameters, keyed ``module.param`` (sampled steps only)."""
        return {f"{n}.{pn}" if n else pn: p.detach().clone()
                for n, m in self.modules.items() for pn, p in m.named_parameters(recurse=False)}

    def record_updates(self, before: Mapping[str, torch.Tensor],
                       after: Mapping[str, torch.Tensor] | None = None, *,
                       storage_dtypes: Mapping[str, torch.dtype] | None = None) -> None:
        """Add ``update`` rows for the current sample from ``before``/``after`` tensors keyed ``module.param``.

        ``after`` defaults to the live parameters; ``storage_dtypes`` (default: each ``before``
        tensor's dtype) lets a caller pass FP32 master copies while asking about BF16/FP16 storage.
        Outside an active sample this does nothing.
        """
        s = self._current
        if s is None:
            return
        live = self.snapshot_refs() if after is None else after
        for key, b in before.items():
            module = key.rpartition(".")[0]
            dt = (storage_dtypes or {}).get(key, b.dtype)
            s.add(module, "update", dt, b.numel(), update_counts(b, live[key], dt))

    def snapshot_refs(self) -> dict[str, torch.Tensor]:
        """The live monitored parameters (no copy), keyed like :meth:`snapshot`."""
        return {f"{n}.{pn}" if n else pn: p
                for n, m in self.modules.items() for pn, p in m.named_parameters(recurse=False)}

    @contextlib.contextmanager
    def track_updates(self, optimizer: object | None = None) -> Iterator[None]:
        """Wrap ``optimizer.step()`` (or ``scaler.step(optimizer)``): on a sampled step, snapshot
        before and record ``update`` rows after; otherwise do nothing at all.

        With a master-weight optimizer (one with ``master_of(param)``, e.g. mixprec.optim's), pass
        it: the FP32 master updates are measured against the ULP of each parameter's *storage*
        dtype, i.e. the share of this step's updates that a 16-bit copy without masters would lose.
        Without it the stored parameters themselves are compared (an update lost to rounding shows
        as no change, which counts as below half an ULP).
        """
        if self._current is None:
            yield
            return
        master_of = getattr(optimizer, "master_of", None)
        if master_of is None:
            before = self.snapshot()
            yield
            self.record_updates(before)
            return
        live = self.snapshot_refs()
        keys = [k for k, p in live.items() if p.requires_grad]
        before = {k: master_of(live[k]).detach().clone() for k in keys}
        yield
        # Asked again after the step: a split master (mixprec.optim.split) is a fresh FP32 copy.
        after = {k: master_of(live[k]) for k in keys}
        self.record_updates(before, after, storage_dtypes={k: live[k].dtype for k in keys})
