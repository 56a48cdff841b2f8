"""DDP communication hooks: plain, FP16/BF16-compressed and top-k sparsified gradient all-reduce.

DDP hands each hook a *bucket*: a flat buffer holding the local gradients of several parameters
(about ``bucket_cap_mb`` each). The hook returns a future of the averaged buffer. Every hook here
counts what it put into the collective, so ``strategy.comm_stats()`` can say what compression
saved:

* ``values_sent`` / ``values_dense``  gradient values contributed vs the bucket's size,
* ``bytes_sent`` / ``bytes_dense``    payload bytes contributed vs the uncompressed buffer,
* ``wire_bytes``                      an estimate of bytes each rank moves over the network:
  ``2 (p-1)/p x payload`` for a ring all-reduce, ``(p-1) x payload`` for an all-gather — which is
  why top-k's advantage shrinks as the number of ranks ``p`` grows,
* ``collectives``                     hook calls (one per bucket per synchronised backward).

FP16/BF16 reuse PyTorch's ``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``
(cast, divide by ``p``, all-reduce, cast back).

**Top-k with error feedback.** Each rank adds the residual it kept from earlier steps to the new
gradient, sends only the ``k = max(1, floor(ratio x n))`` entries of largest magnitude as ``(value,
int32 index)`` pairs through one ``all_gather`` (sums of sparse vectors with different supports
are not sparse, so an all-reduce cannot carry them), scatters every rank's pairs into a dense
buffer and divides by ``p``. What was not sent stays in the residual, so no gradient mass is lost,
only delayed. Residuals are per bucket and per rank; :meth:`TopKState.state_dict` exposes them
for checkpoints. On a step whose accumulated gradient is not finite (an FP16 overflow, which the
scaler will skip) the old residual is kept, so one overflow does not poison every later step —
this costs no host sync (``torch.where`` on a device flag). The residual is in the units of the
gradient the hook sees, i.e. loss-scaled under FP16; after a loss-scale back-off it is over-weighted
by the back-off factor until it has been sent, a bounded, transient error.

DDP rebuilds its buckets after the first iteration (to follow the order gradients become ready),
and a resumed run may bucket differently, so each residual remembers which parameters it covers;
when a bucket's layout changes its residual is re-cut per parameter instead of being misapplied.
"""

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

__all__ = ["CommCounter", "HookState", "TopKState", "allreduce_hook", "fp16_hook", "bf16_hook",
           "topk_hook", "make_hook", "COMPRESSIONS"]

COMPRESSIONS = ("none", "fp16", "bf16", "topk")


@dataclass
class CommCounter:
    """Running totals of what this rank contributed to gradient collectives."""

    values_sent: int = 0
    values_dense: int = 0
    bytes_sent: int = 0
    bytes_dense: int = 0
    wire_bytes: float = 0.0
    collectives: int = 0

    def add(self, *, values_sent: int, values_dense: int, bytes_sent: int, bytes_dense: int,
            wire_bytes: float) -> None:
        self.values_sent += values_sent
        self.values_dense += values_dense
        self.bytes_sent += bytes_sent
        self.bytes_dense += bytes_dense
        self.wire_bytes += wire_bytes
        self.collectives += 1

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def load(self, d: dict) -> None:
        for f in fields(self):
            if f.name in d:
                setattr(self, f.name, type(getattr(self, f.name))(d[f.name]))


@dataclass
class HookState:
    """What every hook receives: its process group (None = default) and its counter."""

    process_group: dist.ProcessGroup | None = None
    counter: CommCounter = field(default_factory=CommCounter)

    def world(self) -> int:
        return dist.get_world_size(self.process_group)

    def state_dict(self) -> dict:
        return {"counter": self.counter.as_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.counter.load(state.get("counter", {}))


def _count_allreduce(state: HookState, buf: torch.Tensor, wire_dtype: torch.dtype) -> None:
    n, p = buf.numel(), state.world()
    sent = n * torch.empty((), dtype=wire_dtype).element_size()
    state.counter.add(values_sent=n, values_dense=n, bytes_sent=sent,
                      bytes_dense=n * buf.element_size(), wire_bytes=2 * (p - 1) / p * sent)


def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Plain averaged all-reduce (what DDP does without a hook), counted."""
    _count_allreduce(state, bucket.buffer(), bucket.buffer().dtype)
    return default_hooks.allreduce_hook(state.process_group, bucket)


def fp16_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce in FP16 (PyTorch's ``fp16_compress_hook``), counted.

    Divides by ``p`` *before* the cast, so the sum cannot overflow FP16's 65504 unless a single
    averaged value does; values below FP16's 6e-8 subnormal floor are flushed to zero.
    """
    _count_allreduce(state, bucket.buffer(), torch.float16)
    return default_hooks.fp16_compress_hook(state.process_group, bucket)


def bf16_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce in BF16 (PyTorch's ``bf16_compress_hook``), counted: FP32's range, 8 bits of
    mantissa, so no overflow but ~3 significant digits per summand."""
    _count_allreduce(state, bucket.buffer(), torch.bfloat16)
    return default_hooks.bf16_compress_hook(state.process_group, bucket)


@dataclass
class TopKState(HookState):
    """Top-k settings and this rank's error-feedback residuals, one flat FP32 tensor per bucket."""

    ratio: float = 0.3
    """Fraction of each bucket's values sent per step, in (0, 1] (rounded down, at least one)."""
    param_index: dict[int, int] = field(default_factory=dict)
    """``param.data_ptr()`` -> position in ``model.parameters()``; makes layouts checkpointable."""
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    """Bucket index -> flat FP32 residual (what was not sent yet)."""
    layouts: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    """Bucket index -> ((parameter position, numel), ...) in buffer order."""
    pending: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per-parameter residuals waiting for their new bucket after a layout change."""

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"topk ratio must be in (0, 1], got {self.ratio}")

    def residual_for(self, bucket: int, layout: tuple[tuple[int, int], ...], n: int,
                     device: torch.device) -> torch.Tensor:
        """The residual for ``bucket``, re-cut from per-parameter pieces if the layout changed.

        DDP rebuilds its buckets after the first iteration (to follow the order gradients become
        ready), and a resumed run may bucket differently; the residual follows the parameters.
        """
        if self.layouts.get(bucket) == layout:
            return self.residuals[bucket].to(device, non_blocking=True)
        for b, old in self.layouts.items():  # flatten every bucket once, then re-cut on demand
            pieces = self.residuals[b].split([numel for _, numel in old])
            self.pending.update({key: piece for (key, _), piece in zip(old, pieces, strict=True)})
        self.layouts.clear()
        self.residuals.clear()
        if not self.pending:
            return torch.zeros(n, dtype=torch.float32, device=device)
        parts = [self.pending.pop(key, None) for key, _ in layout]
        return torch.cat([torch.zeros(numel, dtype=torch.float32) if t is None else t.float().cpu()
                          for t, (_, numel) in zip(parts, layout, strict=True)]).to(device)

    def state_dict(self) -> dict:
        return {"counter": self.counter.as_dict(), "ratio": self.ratio,
                "residuals": {i: r.detach().cpu() for i, r in self.residuals.items()},
                "layouts": {i: [list(x) for x in lay] for i, lay in self.layouts.items()},
                "pending": {i: r.detach().cpu() for i, r in self.pending.items()}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.residuals = {int(i): r.clone() for i, r in state.get("residuals", {}).items()}
        self.layouts = {int(i): tuple(tuple(x) for x in lay) for i, lay in state.get("layouts", {}).items()}
        self.pending = {int(i): r.clone() for i, r in state.get("pending", {}).items()}


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Send the top ``ratio`` of (gradient + residual) by magnitude; keep the rest as residual."""
    buf = bucket.buffer()                                       # (n,) flat local gradients
    b, n, p = bucket.index(), buf.numel(), state.world()
    layout = tuple((state.param_index.get(t.data_ptr(), t.data_ptr()), t.numel())
                   for t in bucket.parameters())
    res = state.residual_for(b, layout, n, buf.device)
    acc = buf.float() + res                                     # (n,) fp32: small residuals survive
    k = max(1, int(state.ratio * n))
    top = torch.topk(acc.abs(), k, sorted=False).indices        # (k,) NaN/inf sort first: they are sent
    vals = acc.index_select(0, top).to(buf.dtype)               # (k,)
    keep_old = ~torch.isfinite(acc).all()                       # device flag, no host sync
    state.residuals[b] = torch.where(keep_old, res, acc.index_fill_(0, top, 0.0))
    state.layouts[b] = layout

    payload = torch.cat([vals.view(torch.uint8), top.to(torch.int32).view(torch.uint8)])  # (k*(s+4),)
    state.counter.add(values_sent=k, values_dense=n, bytes_sent=payload.numel(),
                      bytes_dense=n * buf.element_size(), wire_bytes=(p - 1) * payload.numel())
    gathered = torch.empty((p, payload.numel()), dtype=torch.uint8, device=buf.device)
    work = dist.all_gather(list(gathered.unbind(0)), payload, group=state.process_group,
                           async_op=True)
    value_bytes = k * vals.element_size()

    def scatter_average(fut: torch.futures.Future) -> torch.Tensor:
        all_vals = gathered[:, :value_bytes].contiguous().view(buf.dtype).reshape(-1)   # (p*k,)
        all_idx = gathered[:, value_bytes:].contiguous().view(torch.int32).reshape(-1)  # (p*k,)
        dense = torch.zeros(n, dtype=torch.float32, device=buf.device)
        dense.index_add_(0, all_idx.long(), all_vals.float())
        buf.copy_(dense.div_(p))
        return buf

    return work.get_future().then(scatter_average)


_HOOKS: dict[str, Callable] = {"none": allreduce_hook, "fp16": fp16_hook, "bf16": bf16_hook,
                               "topk": topk_hook}


def make_hook(compression: str, *, topk_ratio: float = 0.3,
              process_group: dist.ProcessGroup | None = None) -> tuple[HookState, Callable]:
    """The ``(state, hook)`` pair for ``DistributedDataParallel.register_comm_hook``."""
    if compression not in _HOOKS:
        raise ValueError(f"unknown gradient compression {compression!r}; valid: {', '.join(COMPRESSIONS)}")
    if compression == "topk":
        return TopKState(process_group=process_group, ratio=topk_ratio), topk_hook
    return HookState(process_group=process_group), _HOOKS[compression]
