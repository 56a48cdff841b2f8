"""The master-weight step as a fixed number of fused ops on flat buffers, whatever the model size.

Why: a GPU pays per launch. Stepping a torch optimizer over a list of a few hundred masters,
widening split masters param by param and finding their rounding ties with ``nonzero`` cost about
1450 dispatched ops and a host sync per chunk on a 406M GPT (docs/performance.md, "The step's
cost model"); torch's fused AdamW over one flat tensor costs about 14. So the step here works on
*chunks*: consecutive masters of one param group on one device, about ``split.FLAT_CHUNKS`` per
group and device, between ``split.CHUNK_NUMEL`` and ``split.FLAT_CHUNK_MAX`` elements each
(``split.flat_chunk_numel``; a larger tensor is a chunk of its own). So a step costs a fixed
number of ops up to about 0.5 G parameters (one chunk per group on the small models of the tests)
and beyond that more chunks of ops far longer than a launch; the scratch costs at most about one
byte per parameter and 512 MiB, during the step only. On a CPU, where a dispatch costs nothing
but cache misses do, chunks are ``split.CPU_CHUNK_NUMEL`` (256 Ki) elements. Each chunk has,
allocated once:

* a slot per master in two FP32 scratch buffers shared by all chunks of a device (the values
  ``W`` and the gradients ``G``; the largest chunk sets their size, so the transient memory stays
  bounded as with the earlier chunked step), and every per-master view of them;
* its optimizer state as flat tensors, owned by a private *twin* of the inner optimizer (the same
  class and arguments) whose one parameter per chunk is the chunk's slice of ``W``. The inner
  optimizer's per-master state (what ``state_dict()`` saves) holds views of those flat tensors, so
  the checkpoint format is unchanged and nothing is copied between the two;
* for split masters (mixprec.optim.split), a dense tie bitmap: one bit per element saying that
  the element's remainder ``-2**15`` means ``+2**15`` (an exact tie that rounded down to an even
  BF16 value). It replaces the sparse list of tie indices, whose length depended on the data and
  whose construction needed ``nonzero`` and ``bincount(...).tolist()`` (host syncs).

One chunk's step, each line one dispatched op over the whole chunk (``torch._foreach_*`` over its
lists, or one op on its flat slice)::

    W[split] <- bf16 params (exact), W[split].bits += remainder, W.bits += 2**16 * ties
    W[own]   <- FP32 masters / FP32 params that are their own master
    G[split] <- bf16 grads (exact), times each pending factor (1/scale, clip coefficient)
    G[own]   <- FP32 master grads (unscaled and clipped in place by the scaler already)
    twin.step()                     the inner optimizer's own math, on one flat tensor (on CUDA:
                                    one fused kernel launch, mixprec.optim.adamw_triton, below)
    bf16 params <- W[split] (round to nearest even), remainder <- low halves of W[split], ties
    FP32 masters / own params <- W[own], 16-bit params of full masters <- W[full] (rounded)

Bit-identity: an elementwise optimizer (``mixprec.optim.parts.SEPARABLE``, or a class declaring
``mixprec_chunk_exact``) computes each element from that element's value, gradient and state and
its group's hyper-parameters only, so one call over the concatenation gives every element the
value the per-master call gave (tests/optim/test_step_cost.py checks it against per-tensor steps;
tests/optim/test_split_masters.py checks split against full masters with tolerance 0). Rounding
noise (BF16 moments, int8 codes) is drawn per chunk: split and full masters cut the same chunks
and draw the same noise; the per-master step cuts ``CHUNK_NUMEL`` chunks, the same ones for a
param group under ``FLAT_CHUNKS * CHUNK_NUMEL`` (32 Mi) elements on an accelerator and under
``CPU_CHUNK_NUMEL`` elements on a CPU, other (equally distributed) noise above.

What falls back to the per-master step (``MasterWeights._step_per_master`` in
mixprec.optim.master; for split masters ``SplitMasterWeights._step_split`` in
mixprec.optim.split_masters, which steps FP32 tensors of the inner optimizer's own, no ``.data``
swap): an optimizer that is not elementwise, a step issued in parts (the overlap engine), masters
whose grads were widened by ``master_grads()`` for torch's scaler, and any step in which some
trainable master has no gradient (torch then skips only that master; the flat state would advance
it too). 8-bit moments step flat: their codes are decoded into FP32 scratch around the twin's step.

Why the twin is driven once per chunk, not once per step: one ``twin.step()`` over every chunk's
flat tensor needs the FP32 values and gradients of every chunk at once, 8 bytes per trainable
parameter during the step (the scratch of full FP32 masters and grads, which split masters exist
to avoid), where the shared per-device slots cost at most about one byte per parameter and
512 MiB. Within that bound one twin step would save nothing: on an accelerator a group has
several chunks only when it is too large for them to coexist (on a CPU they are cache-sized by
choice), and chunks of different groups (other hyper-parameters) get one pass of the
optimizer's math per group anyway. So each chunk costs its own update and gather/scatter (7 to 24
ops; docs/performance.md has the counts). On a CPU the update is ``twin.step()`` (12 dispatched
ops for torch's AdamW, 33 with BF16 moments, 23 for the FP32 scratch of 8-bit moments). On CUDA,
after a chunk's first step (the twin's: it makes the state in its own layout), no inner optimizer
is re-driven: the twin's AdamW update is one Triton kernel launch per chunk
(mixprec.optim.adamw_triton: torch's CUDA foreach AdamW's operations in its order, FP32 or BF16
moments, the twin's rounding noise, nothing written where ``found_inf`` is set, so a masked step
needs no ``torch.where`` over the values and moments), when the twin is torch's ``AdamW`` or
mixprec's FP32-math AdamW with options the kernel does (no amsgrad, maximize, capturable, fused,
tensor lr), Triton imports, and the kernel's probe gives torch's foreach AdamW's bits on the
device (once per device, :func:`kernel_agrees`); else the twin steps, and one log line says why
(:func:`kernel_refusal`). The twin still owns the state and the step counter (a CPU tensor,
advanced on the host as the twin does), so checkpoints are unchanged; split and full masters take
the same path on a device. 8-bit moments are decoded and encoded around the kernel as around the
twin. Validated under Triton's interpreter only so far (no GPU lent, 2026-12-05).

Frozen parameters (``requires_grad=False``) are left out of the chunks; freezing or unfreezing
makes them again. After a per-master step, or when params are unfrozen, a chunk adopts the
per-master state again (a one-time concatenation); where the masters' step counts now differ (a
param unfrozen after others stepped, a step that skipped a master) the chunks are made again,
grouped by step count, since a chunk shares one counter.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.profiler import record_function

from mixprec.optim import moments as _moments, split as _split

__all__ = ["Chunk", "FlatSteps", "unpack_ties", "pack_ties_", "kernel_refusal", "kernel_agrees"]

_TIE = 1 << 15
_log = logging.getLogger(__name__)

KERNEL_DEVICES = ("cuda",)
"""Device types whose chunks may take the fused kernel (mixprec.optim.adamw_triton); the CPU
keeps the twin's foreach step, whose op counts tests/optim/test_step_cost.py pins."""

PROBE_REL_TOL = 0.0
"""The probe's bound on max |kernel - twin| / max |twin| (values and moments after three steps):
0, bit for bit. The kernel does torch's CUDA foreach AdamW's operations in its order with the same
fused multiply-adds (mixprec.optim.adamw_triton), and mixprec promises more than split = full: on
a GPU, masters follow torch's FP32 optimizer bit for bit (tests/cuda/test_cuda_master_weights.py).
A GPU where the kernel is off by an ulp keeps the twin; the log line gives the measured error.
Under the interpreter on a CPU, where torch's kernels order two operations otherwise, the tests
set it to their measured bound."""


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _probe_case(device: torch.device) -> tuple[Tensor, list[Tensor]]:
    gen = torch.Generator().manual_seed(0)
    n = 3001                                       # ragged: not a multiple of the kernel's block
    w = torch.randn(n, generator=gen).to(device)
    return w, [(torch.randn(n, generator=gen) * 1e-2).to(device) for _ in range(3)]


def _rel_err(got: Tensor, ref: Tensor) -> Tensor:
    return (got.float() - ref.float()).abs().max() / ref.float().abs().max()


def kernel_agrees(kernel: Callable[..., None], device: torch.device) -> bool:
    """Whether ``kernel`` (``adamw_triton.adamw_chunk_``'s signature) runs on ``device`` and does
    the twin's step there, on a ragged chunk of 3001 elements: three steps with FP32 moments and
    weight decay within :data:`PROBE_REL_TOL` (0: bit for bit) of torch's foreach AdamW (values
    and moments); its first step with BF16 moments gives the FP32 run's values bit for bit and its
    moments rounded to nearest, or with the given noise as ``_AdamWFP32Math`` rounds them
    (mixprec.optim.adamw); and a step with the flag set writes nothing. A few host reads: run
    once per device."""
    hyper = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    args = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
    try:
        w0, grads = _probe_case(device)
        p, w = w0.clone(), w0.clone()
        twin = torch.optim.AdamW([p], foreach=True, **hyper)          # type: ignore[arg-type]
        m, v = torch.zeros_like(w), torch.zeros_like(w)
        firsts: list[Tensor] = []
        for t, g in enumerate(grads, 1):
            p.grad = g.clone()
            twin.step()
            kernel(w, g, m, v, step=float(t), **args)
            if t == 1:
                firsts = [w.clone(), m.clone(), v.clone()]
        st = twin.state[p]
        err = max(float(_rel_err(a, b)) for a, b in ((w, p), (m, st["exp_avg"]), (v, st["exp_avg_sq"])))
        if not err <= PROBE_REL_TOL:
            _log.info("mixprec's AdamW kernel disagreed with torch's foreach AdamW on %s: max rel err %.3g "
                      "(allowed %.3g)", device, err, PROBE_REL_TOL)
            return False
        gen = torch.Generator(device=device).manual_seed(0)
        noise = tuple(torch.randint(0, 1 << 16, w.shape, dtype=torch.int32, device=device, generator=gen)
                      for _ in range(2))
        for nz in (None, noise):                   # BF16 moments: to nearest, then stochastically
            wb = w0.clone()
            mb, vb = torch.zeros_like(w, dtype=torch.bfloat16), torch.zeros_like(w, dtype=torch.bfloat16)
            kernel(wb, grads[0], mb, vb, step=1.0, noise=nz, **args)
            want = [x.to(torch.bfloat16) if nz is None else
                    x.view(torch.int32).add(r).bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)
                    for x, r in zip(firsts[1:], nz or (None, None))]
            if not (torch.equal(wb, firsts[0]) and torch.equal(mb, want[0]) and torch.equal(vb, want[1])):
                return False
        before = [t.clone() for t in (w, m, v)]
        kernel(w, grads[0], m, v, step=4.0, found=torch.ones((), dtype=torch.bool, device=device), **args)
        if not all(torch.equal(a, b) for a, b in zip(before, (w, m, v))):
            return False
    except Exception as e:                # a kernel that fails to compile or launch: the twin
        _log.info("mixprec's AdamW kernel failed its probe on %s: %s", device, e)
        return False
    return True


@functools.cache
def _kernel_agrees_on(device: str) -> bool:
    from mixprec.optim.adamw_triton import adamw_chunk_      # optional: Triton
    return kernel_agrees(adamw_chunk_, torch.device(device))


_UNSUPPORTED = ("amsgrad", "maximize", "capturable", "differentiable", "fused")


def kernel_refusal(twin: torch.optim.Optimizer, hyper: dict[str, Any], device: torch.device) -> str | None:
    """Why a chunk of ``twin`` with the group's ``hyper`` on ``device`` keeps the twin's step
    rather than the fused kernel (mixprec.optim.adamw_triton); None: it takes the kernel."""
    if device.type not in KERNEL_DEVICES:
        return f"the fused AdamW kernel runs on {', '.join(KERNEL_DEVICES)} only, not {device.type}"
    if type(twin) is not torch.optim.AdamW and not vars(type(twin)).get("mixprec_adamw_ops", False):
        return f"the fused kernel does AdamW, not {type(twin).__name__}"
    for key in _UNSUPPORTED:
        if hyper.get(key):
            return f"the fused AdamW kernel does not support {key}=True"
    if hyper.get("foreach") is False:
        return "foreach=False: the twin's per-tensor kernels order the math otherwise"
    if isinstance(hyper.get("lr"), Tensor) or isinstance(hyper.get("betas", (0,))[0], Tensor):
        return "a tensor lr or betas (the kernel takes host scalars)"
    if hyper.get("decoupled_weight_decay") is False:
        return "decoupled_weight_decay=False (L2 penalty): not AdamW"
    if not _triton_importable():
        return "Triton is not importable"
    if not _kernel_agrees_on(str(device)):
        return "mixprec's AdamW kernel failed or disagreed with the twin's foreach step in its probe"
    return None


def unpack_ties(bits: Tensor, n: int, shifts: Tensor) -> Tensor:
    """The first ``n`` tie flags of a packed bitmap (uint8, bit ``j`` of byte ``i`` is element
    ``8 i + j``), as a uint8 tensor of 0/1."""
    return bits.unsqueeze(1).bitwise_right_shift(shifts).bitwise_and_(1).view(-1)[:n]


def pack_ties_(bits: Tensor, flags: Tensor, shifts: Tensor) -> None:
    """Pack bool ``flags`` (length ``8 * bits.numel()``) into ``bits`` in place."""
    packed = flags.view(-1, 8).to(torch.uint8).bitwise_left_shift_(shifts).sum(1, dtype=torch.uint8)
    bits.copy_(packed)


def _queues_copy(step: Tensor, skip: Tensor) -> bool:
    """Whether stepping ``step`` (a host counter) back by the device flag ``skip`` must wait for
    the flag: then the step queues a host copy and :meth:`FlatSteps.settle` reads it later."""
    return step.device != skip.device


class _Bytes:
    """The bytes of a list of tensors (8-bit codes, their scales, FP32 vector moments) as views
    made once, to keep and restore them with a fixed number of ops: one foreach copy into a flat
    byte buffer, and ``torch.where`` over it."""

    def __init__(self, tensors: list[Tensor]) -> None:
        self.views = [t.view(-1).view(torch.uint8) for t in tensors]
        self.sizes = [v.numel() for v in self.views]
        self.device = tensors[0].device

    def copy(self) -> Tensor:
        """The bytes now, in a fresh flat buffer (transient: the step's lifetime)."""
        out = torch.empty(sum(self.sizes), dtype=torch.uint8, device=self.device)
        torch._foreach_copy_(list(out.split(self.sizes)), self.views)
        return out

    def restore_where(self, old: Tensor, skip: Tensor) -> None:
        now = self.copy()
        torch.where(skip, old, now, out=now)
        torch._foreach_copy_(self.views, list(now.split(self.sizes)))


class Chunk:
    """Consecutive masters of one param group on one device, stepped as one flat tensor.

    ``kinds[i]``: ``"split"`` (the BF16 model param + int16 remainder + tie bit), ``"full"`` (a
    separate FP32 master, its 16-bit model param rounded from it) or ``"self"`` (an FP32 param that
    is its own master)."""

    def __init__(self, group: int, masters: list[Tensor], models: list[Tensor], kinds: list[str],
                 los: list[Tensor | None], w: Tensor, g: Tensor, shifts: Tensor, flags: Tensor,
                 mv: tuple[Tensor, Tensor] | None = None) -> None:
        self.group = group
        self.masters, self.models, self.kinds = masters, models, kinds
        self.numels = [p.numel() for p in models]
        self.numel = n = sum(self.numels)
        self.starts = [0]
        for k in self.numels[:-1]:
            self.starts.append(self.starts[-1] + k)
        self.param = w[:n]                 # the twin's parameter: this chunk's slice of W
        self.param.grad = g[:n]
        self.w_views = [self.param[a:a + k].view(p.shape) for a, k, p in zip(self.starts, self.numels, models)]
        self.g_views = [self.param.grad[a:a + k].view(p.shape) for a, k, p in zip(self.starts, self.numels, models)]
        sp = [i for i, k in enumerate(kinds) if k == "split"]
        own = [i for i, k in enumerate(kinds) if k != "split"]
        full = [i for i, k in enumerate(kinds) if k == "full"]
        self.split_idx, self.own_idx, self.full_idx = sp, own, full
        self.split_models = [models[i] for i in sp]
        self.split_w = [self.w_views[i] for i in sp]
        self.split_g = [self.g_views[i] for i in sp]
        self.split_bits = [self.w_views[i].view(torch.int32) for i in sp]
        self.split_lo = [los[i] for i in sp]
        self.split_lo_flat = [los[i].view(-1) for i in sp]
        low, high = _split._halves(self.param)            # flat int16 views of W's halves
        self.low, self.high = low, high
        self.split_low = [low[self.starts[i]:self.starts[i] + self.numels[i]] for i in sp]
        self.own_masters = [masters[i] for i in own]
        self.own_w = [self.w_views[i] for i in own]
        self.own_g = [self.g_views[i] for i in own]
        self.full_models = [models[i] for i in full]
        self.full_w = [self.w_views[i] for i in full]
        self.bits_int = self.param.view(torch.int32)
        nbytes = (n + 7) // 8 if sp else 0
        self.ties = torch.zeros(nbytes, dtype=torch.uint8, device=w.device)   # 1 bit per element, kept
        self.flags = flags[:nbytes * 8]         # bool scratch (shared), its padding zeroed per use
        self.flags_head, self.flags_tail = self.flags[:n], self.flags[n:]
        self.shifts = shifts
        # 8-bit moments: FP32 scratch slots the codes are decoded into and encoded from, and the
        # packing views of mixprec.optim.moments, made at the first step (reset with the state)
        self.m_views = self.v_views = None
        self.moments: dict[str, Tensor] | None = None
        if mv is not None:
            self.moments = {"exp_avg": mv[0][:n], "exp_avg_sq": mv[1][:n]}
            self.m_views = [mv[0][a:a + k].view(p.shape) for a, k, p in zip(self.starts, self.numels, models)]
            self.v_views = [mv[1][a:a + k].view(p.shape) for a, k, p in zip(self.starts, self.numels, models)]
        self.cache: dict = {}
        self.stored: _Bytes | None = None    # 8-bit state as bytes, for a step skipped on the device
        self.coded: list[int] = []
        self.plain: list[int] = []
        self.ties_packed = False   # False: the owner's per-master tie lists hold the truth
        self.viewed = False        # the inner optimizer's per-master state are views of the twin's
        self.shared: dict[str, Tensor] = {}    # the twin's tensors those views were made of
        self.synced = False        # the twin's state is this chunk's state (adopted or created)


class FlatSteps:
    """The flat step of a :class:`mixprec.optim.MasterWeights` (its chunks, scratch and twin), of
    any layout: a chunk holds split, full and self-mastered members side by side.

    Built from the owner's param groups once (again after ``add_param_group``); the owner decides
    each step whether the flat step applies (``mixprec.optim.flat_dispatch.ready``)."""

    def __init__(self, groups: list[list[tuple[Tensor, Tensor, str, Tensor | None, float | None]]],
                 make_twin: Callable[[list[Tensor]], torch.optim.Optimizer],
                 inner: torch.optim.Optimizer, moments: str | None = None) -> None:
        self.inner = inner
        self.key: tuple[int, ...] = ()   # the owner's trainable masters these chunks were made for
        self.pool: dict = {}         # 8-bit packing buffers, one per device and block length
        self.moments = moments       # 8-bit moments ("int8", "fp8", ...): decoded around the twin's step
        self.kernel_notes: dict[str, str] = {}   # per device: "kernel", or why its chunks keep the twin
        self._pending: list[tuple[Tensor, tuple[Tensor, Tensor, Any]]] = []   # counters to step back
        self._copies: dict[int, tuple[Tensor, Tensor, Any]] = {}                # (see settle)
        plan: list[tuple[int, torch.device, list[tuple[Tensor, Tensor, str, Tensor | None, float | None]]]] = []
        need: dict[torch.device, int] = {}
        for gi, members in enumerate(groups):
            # per device, and per step count (one counter per chunk): one cohort in a normal run
            by_device: dict[tuple[torch.device, float | None], list] = {}
            for mem in members:
                by_device.setdefault((mem[1].device, mem[4]), []).append(mem)
            for (dev, _), mems in by_device.items():
                numels = [mem[1].numel() for mem in mems]
                for a, b in _split.chunks(numels, _split.flat_chunk_numel(sum(numels), dev.type)):
                    plan.append((gi, dev, mems[a:b]))
                    need[dev] = max(need.get(dev, 0), sum(mem[1].numel() for mem in mems[a:b]))
        self.w = {dev: torch.empty(n, dtype=torch.float32, device=dev) for dev, n in need.items()}
        self.g = {dev: torch.empty(n, dtype=torch.float32, device=dev) for dev, n in need.items()}
        flags = {dev: torch.zeros((n + 7) // 8 * 8, dtype=torch.bool, device=dev) for dev, n in need.items()}
        shifts = {dev: torch.arange(8, dtype=torch.uint8, device=dev) for dev in need}
        mv = {dev: (torch.empty(n, dtype=torch.float32, device=dev), torch.empty(n, dtype=torch.float32, device=dev))
              for dev, n in need.items()} if moments else {}
        # Scratch lives only during a step: its storage is freed after it and allocated again
        # before the next (the views made once stay valid: FSDP2 frees its buffers this way).
        self._scratch = [*self.w.values(), *self.g.values(), *flags.values(), *(t for ts in mv.values() for t in ts)]
        self.held = True
        self.chunks = [Chunk(gi, [mem[0] for mem in mems], [mem[1] for mem in mems],
                           [mem[2] for mem in mems], [mem[3] for mem in mems],
                           self.w[dev], self.g[dev], shifts[dev], flags[dev], mv.get(dev))
                       for gi, dev, mems in plan]
        self.twin = make_twin([c.param for c in self.chunks])

    def acquire(self) -> None:
        """Give the scratch buffers their memory back (before the step's first use of them)."""
        if not self.held:
            for t in self._scratch + list(self.pool.values()):
                t.untyped_storage().resize_(t.numel() * t.element_size())
            self.held = True

    def release(self) -> None:
        """Free the scratch buffers' memory (after the step): no memory between steps."""
        if self.held:
            for t in self._scratch + list(self.pool.values()):
                t.untyped_storage().resize_(0)
            self.held = False

    # ------------------------------------------------------------------ state: twin <-> inner

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

    def unshare(self, inner_state: dict[Tensor, dict[str, Any]]) -> None:
        """Before a per-master step: give each master its own step counter (the views share one)
        and make every chunk adopt the per-master state again at its next flat step."""
        self.settle()
        for chunk in self.chunks:
            if chunk.viewed:
                for m in chunk.masters:
                    st = inner_state.get(m)
                    if st:
                        inner_state[m] = {k: (v.clone() if isinstance(v, Tensor) and v.dim() == 0 else v)
                                          for k, v in st.items()}
            chunk.viewed = chunk.synced = False

    # ------------------------------------------------------------------ the step

    def _coded_lists(self, chunk: Chunk, inner_state: dict[Tensor, dict[str, Any]]):
        sts = [inner_state[chunk.masters[i]] for i in chunk.coded]
        plain = [inner_state[chunk.masters[i]] for i in chunk.plain]
        return sts, plain

    def _decode(self, chunk: Chunk, inner_state: dict[Tensor, dict[str, Any]]) -> None:
        """The masters' 8-bit (or FP32 vector) moments into the chunk's FP32 moment scratch."""
        sts, plain = self._coded_lists(chunk, inner_state)
        for key, views in (("exp_avg", chunk.m_views), ("exp_avg_sq", chunk.v_views)):
            if sts:
                _moments.decode_(sts, key, [views[i] for i in chunk.coded], self.moments, cache=chunk.cache)
            if plain:
                torch._foreach_copy_([views[i] for i in chunk.plain], [st[key] for st in plain])

    def _encode(self, chunk: Chunk, inner_state: dict[Tensor, dict[str, Any]]) -> None:
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

    def _keep(self, chunk: Chunk, inner_state: dict[Tensor, dict[str, Any]], values: bool = True) -> dict[str, Any]:
        """Copies of what the step is about to change (a masked step; fixed ops per chunk).
        ``values=False``: the fused kernel writes nothing where the flag is set, so only the 8-bit
        codes (encoded again after it) need keeping."""
        kept: dict[str, Any] = {"W": chunk.param.clone()} if values else {}
        st = self.twin.state.get(chunk.param)
        if st and not self.moments and values:
            kept.update({k: v.clone() for k, v in st.items()
                         if isinstance(v, Tensor) and v.dim() == 1 and v.numel() == chunk.numel})
        if self.moments:
            if chunk.stored is None:
                chunk.stored = _Bytes(self._stored_tensors(chunk, inner_state))
            kept["bytes"] = chunk.stored.copy()
        return kept

    def _restore_where(self, chunk: Chunk, inner_state: dict[Tensor, dict[str, Any]], kept: dict[str, Any],
                       skip: Tensor) -> None:
        if "W" in kept:
            torch.where(skip, kept["W"], chunk.param, out=chunk.param)
        st = self.twin.state[chunk.param]
        for k, old in kept.items():
            if k in st:
                torch.where(skip, old, st[k], out=st[k])
        if "bytes" in kept:
            assert chunk.stored is not None
            chunk.stored.restore_where(kept["bytes"], skip)
        step = st.get("step")
        if isinstance(step, Tensor):
            if _queues_copy(step, skip):               # settled before the counter is read again
                self._pending.append((step, self._host_flag(skip)))
            else:                                      # a CPU run: no copy, no wait
                step.sub_(skip.to(dtype=step.dtype))

    def _host_flag(self, skip: Tensor) -> tuple[Tensor, Tensor, Any]:
        """A host copy of the device flag ``skip``, queued without waiting (pinned memory and an
        event on CUDA), one per flag and step."""
        got = self._copies.get(id(skip))
        if got is None:
            host = torch.empty((), dtype=torch.bool, pin_memory=skip.is_cuda)
            host.copy_(skip, non_blocking=skip.is_cuda)
            event = torch.cuda.Event() if skip.is_cuda else None
            if event is not None:
                event.record()
            got = self._copies[id(skip)] = (skip, host, event)     # holds skip: its id stays unique
        return got

    def settle(self) -> None:
        """Step back the counters of chunks whose last step was skipped on an accelerator.

        torch's AdamW keeps ``step`` on the host; the flag is on the device. Stepping the counter
        back at once would copy the flag to the host and wait for it: a sync every step. So the
        masked step queues a host copy of its flag (``_host_flag``) and this reads it before
        anything reads the counters again (the owner calls it at the start of its next step and
        of ``state_dict()``). The copy was queued before the step's update, so by then it waits for
        nothing queued since (``fit()`` reads its own copy of the same flag at the same point,
        ``Trainer.conclude``)."""
        for step, (_, host, event) in self._pending:
            if event is not None:
                event.synchronize()
            if bool(host):
                step.sub_(1)
        self._pending.clear()
        self._copies.clear()

    @staticmethod
    def _stored_tensors(chunk: Chunk, inner_state: dict[Tensor, dict[str, Any]]) -> list[Tensor]:
        out = []
        for m in chunk.masters:
            for k, v in inner_state[m].items():
                if k != "step" and isinstance(v, Tensor):
                    out.append(v)
        return out

    def stateless(self) -> bool:
        """Whether some chunk has no optimizer state yet (its first step): a step skipped there
        must leave no state, which ``torch.where`` cannot express."""
        return not self.moments and any(not self.twin.state.get(c.param) for c in self.chunks)

    def reseed(self) -> None:
        """8-bit moments: start the inner optimizer's rounding noise of this step, as its own
        step does (once per step, from the step count before it: a CPU step counter read)."""
        for opt in (self.inner, self.twin):    # a step skipped on the device drew noise: draw it again
            if hasattr(opt, "_seeded_at"):
                opt._seeded_at = None                                                   # type: ignore[attr-defined]
        if self.moments and self.chunks:
            first = self.twin.state[self.chunks[0].param]["step"]
            self.inner._reseed(int(float(first)), {c.param.device for c in self.chunks})  # type: ignore[attr-defined]

    def _takes_kernel(self, chunk: Chunk, hyper: dict[str, Any]) -> bool:
        """Whether this chunk's update is the fused kernel (mixprec.optim.adamw_triton) instead of
        ``twin.step()``: on CUDA, once the twin has made the chunk's state (its first step is the
        twin's, which creates the state in its own layout), when :func:`kernel_refusal` has no
        objection. The reason is logged once per device; a CPU never takes the kernel."""
        dev = chunk.param.device
        st = self.twin.state.get(chunk.param)
        if dev.type not in KERNEL_DEVICES or not st:
            return False
        step = st.get("step")
        why = kernel_refusal(self.twin, hyper, dev) if isinstance(step, Tensor) and step.device.type == "cpu" \
            else "the step counter is not a CPU tensor (the kernel's bias corrections are host scalars)"
        note = "kernel" if why is None else why
        if self.kernel_notes.get(str(dev)) != note:
            self.kernel_notes[str(dev)] = note
            _log.info("mixprec flat step on %s: %s", dev, "one fused AdamW kernel per chunk" if why is None
                      else f"the twin optimizer steps each chunk ({why})")
        return why is None

    def _kernel_step(self, chunk: Chunk, hyper: dict[str, Any], skip: Tensor | None) -> None:
        """The twin's step as one kernel launch: the same step counter (a CPU tensor, advanced on
        the host as the twin does; a skipped step steps it back, ``_restore_where``), the same
        rounding noise for BF16 moments (the twin's generator, reseeded as its step does, two
        draws: exp_avg's, then exp_avg_sq's), nothing written where ``skip`` is set."""
        from mixprec.optim.adamw_triton import adamw_chunk_       # optional: Triton
        dev, st, twin = chunk.param.device, self.twin.state[chunk.param], self.twin
        step = st["step"]
        noise = None
        if getattr(twin, "stochastic_rounding", False) and st["exp_avg"].dtype == torch.bfloat16:
            twin._reseed(int(float(step)), {dev})                                    # type: ignore[attr-defined]
            gen = twin._generator(dev)                                                # type: ignore[attr-defined]
            noise = tuple(torch.randint(0, 1 << 16, (chunk.numel,), dtype=torch.int32, device=dev, generator=gen)
                          for _ in range(2))
        step.add_(1.0)
        beta1, beta2 = hyper["betas"]
        adamw_chunk_(chunk.param, chunk.param.grad, st["exp_avg"], st["exp_avg_sq"], lr=hyper["lr"], beta1=beta1,
                     beta2=beta2, eps=hyper["eps"], weight_decay=hyper["weight_decay"], step=float(step),
                     found=skip, noise=noise)   # type: ignore[arg-type]

    @torch.no_grad()
    def step_chunk(self, chunk: Chunk, hyper: dict[str, Any], factors: list[Tensor],
                   inner_state: dict[Tensor, dict[str, Any]], skip: Tensor | None = None) -> None:
        """One chunk: gather into ``W``/``G``, the twin's step, scatter back (module docstring).

        ``skip``: a 0-dim bool on the chunk's device; where True, everything the step writes
        keeps its old value (``torch.where`` over the flat buffers, no host sync): the masters
        through ``W`` (the scatter then writes back what was gathered, bit for bit), the twin's
        flat state, 8-bit codes and scales through a byte copy, and the step counter."""
        with record_function("mixprec.master_grad_copy"):      # the gather (profile: casts)
            if chunk.split_idx:
                torch._foreach_copy_(chunk.split_w, chunk.split_models)    # exact BF16 -> FP32
                torch._foreach_add_(chunk.split_bits, chunk.split_lo)       # + remainder (int16 -> int32)
                chunk.bits_int.add_(unpack_ties(chunk.ties, chunk.numel, chunk.shifts), alpha=1 << 16)
                torch._foreach_copy_(chunk.split_g, [p.grad for p in chunk.split_models])
                for f in factors:                                          # unscale, then clip
                    torch._foreach_mul_(chunk.split_g, f.to(chunk.param.device))
            if chunk.own_idx:   # after the tie add: it touched the own slots too
                torch._foreach_copy_(chunk.own_w, chunk.own_masters)
                torch._foreach_copy_(chunk.own_g, [m.grad for m in chunk.own_masters])
        if self.moments:
            self._decode(chunk, inner_state)
        fused = self._takes_kernel(chunk, hyper)
        kept = self._keep(chunk, inner_state, values=not fused) if skip is not None else None
        self.twin.param_groups = [{**hyper, "params": [chunk.param]}]
        if fused:
            self._kernel_step(chunk, hyper, skip)
        else:
            self.twin.step()
        if self.moments:
            self._encode(chunk, inner_state)
        elif not chunk.viewed or any(self.twin.state[chunk.param].get(k) is not v for k, v in chunk.shared.items()):
            self.share(chunk, inner_state)     # first step, or the optimizer replaced a state tensor
        if kept is not None:
            self._restore_where(chunk, inner_state, kept, skip)
        with record_function("mixprec.master_copy_back"):      # the scatter (profile: casts)
            if chunk.split_idx:
                torch._foreach_copy_(chunk.split_models, chunk.split_w)    # round to nearest even
                torch._foreach_copy_(chunk.split_lo_flat, chunk.split_low) # remainder = low half
                tied = torch.eq(chunk.low, -_TIE)                          # 0x8000: a tie either way
                even = chunk.high.bitwise_and(1).eq_(0)                    # ... that rounded down
                torch.logical_and(tied, even, out=chunk.flags_head)
                chunk.flags_tail.zero_()
                pack_ties_(chunk.ties, chunk.flags, chunk.shifts)
            if chunk.own_idx:
                torch._foreach_copy_(chunk.own_masters, chunk.own_w)
            if chunk.full_idx:
                torch._foreach_copy_(chunk.full_models, chunk.full_w)      # round into the model dtype
