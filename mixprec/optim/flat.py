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
device (once per device, ``flat_kernel.kernel_agrees``); else the twin steps, and one log line
says why (``flat_kernel.kernel_refusal``). The twin still owns the state and the step counter (a CPU tensor,
advanced on the host as the twin does), so checkpoints are unchanged; split and full masters take
the same path on a device. 8-bit moments are decoded and encoded around the kernel as around the
twin. Validated under Triton's interpreter only so far (no GPU lent, 2026-12-05).

Frozen parameters (``requires_grad=False``) are left out of the chunks; freezing or unfreezing
makes them again. After a per-master step, or when params are unfrozen, a chunk adopts the
per-master state again (a one-time concatenation); where the masters' step counts now differ (a
param unfrozen after others stepped, a step that skipped a master) the chunks are made again,
grouped by step count, since a chunk shares one counter.

Where each part lives: this module is the step (:class:`FlatSteps`: the chunks made, their
scratch, one chunk's step top to bottom); it composes one object per seam, each in its module:

* ``flat_chunk``: a chunk's slots and views (``Chunk``), its tie bitmap, and the gather into and
  scatter out of ``W``/``G`` around the update;
* ``flat_state``: the state twin <-> inner (``TwinState``: adopt, share, unshare);
* ``flat_codes``: 8-bit moments decoded and encoded around the update (``CodedMoments``);
* ``flat_skip``: a step skipped on the device, kept and restored with ``torch.where``, and the
  host step counters settled later (``SkipMask``);
* ``flat_kernel``: whether a chunk's update is the fused kernel, and its launch (``KernelChoice``,
  ``kernel_refusal``, the probe ``kernel_agrees``).

When the flat step applies and how the optimizer calls it: mixprec.optim.flat_dispatch.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mixprec.optim import split as _split
from mixprec.optim.flat_chunk import Chunk, gather, scatter
from mixprec.optim.flat_codes import CodedMoments
from mixprec.optim.flat_kernel import KernelChoice
from mixprec.optim.flat_skip import SkipMask
from mixprec.optim.flat_state import TwinState

__all__ = ["FlatSteps"]

Member = tuple[Tensor, Tensor, str, Tensor | None, float | None]
"""(master, model param, kind, remainder, step count): mixprec.optim.flat_dispatch.members."""


class FlatSteps:
    """The flat step of a :class:`mixprec.optim.MasterWeights` (its chunks, scratch and twin), of
    any layout: a chunk holds split, full and self-mastered members side by side.

    Built from the owner's param groups once (again after ``add_param_group``); the owner decides
    each step whether the flat step applies (``mixprec.optim.flat_dispatch.ready``). Its parts,
    one per seam (module docstring): ``state`` (:class:`~mixprec.optim.flat_state.TwinState`),
    ``codes`` (:class:`~mixprec.optim.flat_codes.CodedMoments`, None without 8-bit moments),
    ``mask`` (:class:`~mixprec.optim.flat_skip.SkipMask`) and ``kernel``
    (:class:`~mixprec.optim.flat_kernel.KernelChoice`)."""

    def __init__(self, groups: list[list[Member]], make_twin: Callable[[list[Tensor]], torch.optim.Optimizer],
                 inner: torch.optim.Optimizer, moments: str | None = None) -> None:
        self.inner = inner
        self.key: tuple[int, ...] = ()   # the owner's trainable masters these chunks were made for
        self.pool: dict = {}         # 8-bit packing buffers, one per device and block length
        self.moments = moments       # 8-bit moments ("int8", "fp8", ...): decoded around the twin's step
        plan, need = self._plan(groups)
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
        self.state = TwinState(self.twin, inner, moments, self.pool)
        self.codes = CodedMoments(inner, moments) if moments else None
        self.mask = SkipMask(self.twin, moments)
        self.kernel = KernelChoice(self.twin)
        self.kernel_notes = self.kernel.notes    # per device: "kernel", or why its chunks keep the twin

    @staticmethod
    def _plan(groups: list[list[Member]]) -> tuple[list[tuple[int, torch.device, list[Member]]],
                                                   dict[torch.device, int]]:
        """The chunks to make, as (group index, device, members), and the largest chunk per device
        (the size of that device's shared scratch)."""
        plan: list[tuple[int, torch.device, list[Member]]] = []
        need: dict[torch.device, int] = {}
        for gi, members in enumerate(groups):
            # per device, and per step count (one counter per chunk): one cohort in a normal run
            by_device: dict[tuple[torch.device, float | None], list[Member]] = {}
            for mem in members:
                by_device.setdefault((mem[1].device, mem[4]), []).append(mem)
            for (dev, _), mems in by_device.items():
                numels = [mem[1].numel() for mem in mems]
                for a, b in _split.chunks(numels, _split.flat_chunk_numel(sum(numels), dev.type)):
                    plan.append((gi, dev, mems[a:b]))
                    need[dev] = max(need.get(dev, 0), sum(mem[1].numel() for mem in mems[a:b]))
        return plan, need

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
        """Make the twin's state of ``chunk`` its masters' state (``TwinState.adopt``); False when
        they cannot share one (different step counts)."""
        return self.state.adopt(chunk, inner_state)

    def unshare(self, inner_state: dict[Tensor, dict[str, Any]]) -> None:
        """Before a per-master step: the counters settled (:meth:`settle`), then each master's own
        step counter back and every chunk to adopt again at its next flat step (``TwinState.unshare``)."""
        self.settle()
        self.state.unshare(self.chunks, inner_state)

    def settle(self) -> None:
        """Step back the counters of chunks whose last step was skipped on an accelerator
        (``SkipMask.settle``): the owner calls it before its next step and its ``state_dict()``."""
        self.mask.settle()

    # ------------------------------------------------------------------ the step

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

    @torch.no_grad()
    def step_chunk(self, chunk: Chunk, hyper: dict[str, Any], factors: list[Tensor],
                   inner_state: dict[Tensor, dict[str, Any]], skip: Tensor | None = None) -> None:
        """One chunk: gather into ``W``/``G``, the update (the twin's step or the fused kernel),
        scatter back (module docstring).

        ``skip``: a 0-dim bool on the chunk's device; where True, everything the step writes
        keeps its old value (``torch.where`` over the flat buffers, no host sync): the masters
        through ``W`` (the scatter then writes back what was gathered, bit for bit), the twin's
        flat state, 8-bit codes and scales through a byte copy, and the step counter."""
        gather(chunk, factors)
        if self.codes is not None:
            self.codes.decode(chunk, inner_state)
        fused = self.kernel.takes(chunk, hyper)
        kept = self.mask.keep(chunk, inner_state, values=not fused) if skip is not None else None
        self.twin.param_groups = [{**hyper, "params": [chunk.param]}]
        if fused:
            self.kernel.step(chunk, hyper, skip)
        else:
            self.twin.step()
        if self.codes is not None:
            self.codes.encode(chunk, inner_state)
        elif not chunk.viewed or any(self.twin.state[chunk.param].get(k) is not v for k, v in chunk.shared.items()):
            self.state.share(chunk, inner_state)     # first step, or the optimizer replaced a state tensor
        if kept is not None:
            assert skip is not None
            self.mask.restore(chunk, kept, skip)
        scatter(chunk)
