"""When :class:`mixprec.optim.MasterWeights` steps flat (:mod:`mixprec.optim.flat`), and how it
calls the flat step: which masters qualify (:func:`flat_key`), what goes into the chunks
(:func:`members`), the chunks made, kept, or made again when step counts diverged (:func:`ready`;
``MasterWeights._make_flat`` is the call into ``FlatSteps``), the twin of the inner optimizer that
steps them (:func:`make_twin`), and one flat step over all chunks (:func:`step`).

The optimizer is passed in as ``opt``: these read its bookkeeping (masters, their model params,
the inner optimizer, how each master is stored: ``opt._table``) and its layout's answers
(``_step_per_master``, ``_grad_factors``, ``_end_step``), and keep the chunks in ``opt._flat``
(made by ``opt._make_flat()``, left for a per-master step by :func:`leave`, dropped by
:func:`drop`)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.profiler import record_function

from mixprec.optim import inputs as _inputs, sharded as _sharded
from mixprec.optim.flat import FlatSteps, Member

__all__ = ["step_masters", "settle", "leave", "drop", "members", "make_twin", "flat_key", "ready", "take_factors", "step"]

MasterWeights = Any
"""The optimizer these serve: a :class:`mixprec.optim.MasterWeights` (not imported: master.py
imports this module)."""


def step_masters(opt: MasterWeights, inputs: _inputs.StepInputs | None,
                 parts: Sequence[Sequence[Tensor]] | None, around: Any) -> None:
    """``opt.step()`` after its grads are prepared: flat when it applies (:func:`ready`), else
    per master (``opt._step_per_master``); either way the step's transient memory goes after.

    ``inputs.found_inf``: the flat step skips on the device (:func:`step`); the per-master step
    reads the flag on the host first, except where torch's ``fused=True`` inner optimizer steps
    params that are their own master (32-true, ``*-mixed``, no split masters): it gets the flag
    and skips on the device itself (mixprec.optim.inputs). ``inputs.grad_factors`` (the unscale
    factor and clip coefficient of deferred gradients) join those :func:`take_factors` says."""
    found_inf = inputs.found_inf if inputs is not None else None
    if inputs is not None and inputs.grad_factors:
        take_factors(opt, inputs.grad_factors)
    if parts is None and ready(opt):
        try:
            assert opt._flat is not None
            step(opt._flat, opt._inner, opt.param_groups, opt.state, opt._grad_factors(), found_inf)
        finally:
            opt._end_step()
        return
    leave(opt)
    on_device = found_inf is not None and parts is None and not opt.split_count \
        and _inputs.skips_on_device(opt._inner)
    try:
        if found_inf is not None and not on_device and bool(found_inf.item() > 0):   # a host read
            return
        opt._step_per_master(parts, around, found_inf if on_device else None)
    finally:
        opt._end_step()


def take_factors(opt: MasterWeights, factors: list[Tensor]) -> None:
    """``StepInputs``' factors (unscale, then clip) join the pending factors of the gradients
    ``opt.deferred_grads()`` handed out this step (split masters), applied inside the step as the
    scaler's and the clip's own would be. Full masters defer nothing (their FP32 grads were
    unscaled and clipped in place): factors for them are a caller's mistake, refused."""
    deferred = opt.deferred_grads()
    if deferred is None or deferred.closed:
        raise RuntimeError("StepInputs(inv_scale=/clip_coef=) are factors of deferred gradients "
                           "(split masters' deferred_grads()); this optimizer defers none this step")
    deferred.factors.extend(factors)


def settle(opt: MasterWeights) -> None:
    """The chunks' host step counters brought up to date after a step skipped on the device
    (``FlatSteps.settle``): before the next step and before a state dict."""
    if opt._flat is not None:
        opt._flat.settle()


def leave(opt: MasterWeights) -> None:
    """Before a per-master step: the storage's per-master form (split masters' tie lists) and
    per-master step counters back (the chunks share one)."""
    if opt._flat is not None:
        opt._table.leave_flat(opt._flat)
        opt._flat.unshare(opt.state)


def drop(opt: MasterWeights) -> None:
    """Forget the chunks (param groups changed, or a load replaced the state and masters)."""
    if opt._flat is not None:
        leave(opt)
        opt._flat = None


def members(opt: MasterWeights) -> list[list[Member]]:
    """Per param group: (master, model param, kind, remainder, step count) of every trainable
    master, in order (frozen params have no grad: torch skips them, and so do the chunks).
    The step count (None: no state yet) keeps masters that stepped differently apart: a
    chunk shares one counter (read once here, when the chunks are made)."""
    out = []
    for group in opt.param_groups:
        mems = []
        for m in group["params"]:
            p = opt._table.model_of.get(id(m), m)
            if not p.requires_grad:
                continue
            kind = "split" if opt._table.is_split(m) else ("self" if p is m else "full")
            st = opt.state.get(m)
            step_count = float(st["step"]) if st and isinstance(st.get("step"), Tensor) else None
            mems.append((m, p, kind, opt._table.remainder_of(m), step_count))
        out.append(mems)
    return out


def make_twin(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], inner: torch.optim.Optimizer,
              params: list[Tensor]) -> torch.optim.Optimizer:
    """A twin of ``inner`` (built as ``cls(params, **kwargs)``) over flat FP32 chunks."""
    if getattr(inner, "quantized", False):   # FP32 moment scratch: the codes stay the inner's
        return cls(params, **{**kwargs, "moments": None, "moments_dtype": torch.float32,
                              "stochastic_rounding": False, "seed": None})
    if "seed" in kwargs and getattr(inner, "_seed", None) is not None:
        kwargs = {**kwargs, "seed": inner._seed}   # the same rounding noise stream
    return cls(params, **kwargs)


def flat_key(opt: MasterWeights) -> tuple[int, ...] | None:
    """The ids of the masters this step's chunks hold, or None when the step cannot run flat:
    not an elementwise FP32 inner optimizer, FP32 copies widened by ``master_grads()``, a
    trainable master without a gradient (a frozen one with one), a dtype or a DTensor the chunks
    do not take, or only self-mastered params that torch steps as well itself."""
    if not opt._flat_capable or opt._table.widened():
        return None
    if not opt._table.masters and _inputs.takes_found_inf(opt._inner):
        # Only params that are their own master, and torch's fused kernel (fused=True) steps
        # them in one launch per (device, dtype) and skips on the device itself: flat chunks
        # would only add copies.
        return None
    if not opt._table.masters and any(p.device.type != "cpu" for p in opt._table.all_params):
        # Only FP32 params that are their own master (32-true, *-mixed): on an accelerator
        # torch's foreach/fused AdamW already steps them in a fixed number of launches, in
        # place; gathering them into flat chunks would only add three passes over memory.
        return None
    key = []
    for group in opt.param_groups:
        for m in group["params"]:
            p = opt._table.model_of.get(id(m), m)
            g = p.grad if opt._table.is_split(m) else m.grad
            if not p.requires_grad:          # frozen: outside the chunks, unless given a grad
                if g is not None:
                    return None
                continue
            if g is None or p.dtype not in (torch.bfloat16, torch.float16, torch.float32) \
                    or (p is m and p.dtype != torch.float32) or _sharded.is_dtensor(p):
                return None
            key.append(id(m))
    return tuple(key)


def ready(opt: MasterWeights) -> bool:
    """Whether this step runs flat; prepares ``opt._flat`` when it does (made or made again,
    state adopted, the layout's part entered)."""
    key = flat_key(opt)
    if key is None:
        return False
    if opt._flat is not None and opt._flat.key != key:
        drop(opt)                    # params frozen or unfrozen: chunks made again
    for fresh in (opt._flat is None, True):
        if opt._flat is None:
            if not key:
                return False
            opt._flat = opt._make_flat()
            opt._flat.key = key
        opt._flat.acquire()
        if all(chunk.synced or opt._flat.adopt(chunk, opt.state) for chunk in opt._flat.chunks):
            break
        # Step counts diverged inside a chunk (a per-master step skipped some masters):
        # make the chunks again, grouped by step count; if even that fails, stay per master.
        drop(opt)
        if fresh:
            opt._flat_capable = False
            return False
    assert opt._flat is not None
    opt._table.enter_flat(opt._flat)
    return True


def step(flat: FlatSteps, inner: torch.optim.Optimizer, groups: list[dict[str, Any]],
         state: dict[Tensor, Any], factors: list[Tensor], found_inf: Tensor | None) -> None:
    """One flat step over every chunk of ``flat`` (hyperparameters from ``groups``, the state
    views in ``state``); ``found_inf`` skips it on the device (after the first step, which reads
    the flag on the host: a skipped first step must create no state)."""
    skips: dict[torch.device, Tensor] = {}
    if found_inf is not None and flat.stateless():
        # The first step: a skipped one must create no state (torch's meaning of "not
        # stepped"), so this once the host reads the flag first.
        if bool(found_inf.item() > 0):
            return
        found_inf = None
    if found_inf is not None:
        for dev in {c.param.device for c in flat.chunks}:
            skips[dev] = found_inf.to(dev, non_blocking=True) > 0     # stays on the device
    # The inner optimizer's own step hooks still see one step (register_step_pre_hook on
    # ``optimizer.inner``), although its math now runs on the twin's flat tensors.
    for hook in list(inner._optimizer_step_pre_hooks.values()):
        hook(inner, (), {})
    flat.reseed()
    with record_function("mixprec.flat_step"):
        for chunk in flat.chunks:
            hyper = {k: v for k, v in groups[chunk.group].items() if k != "params"}
            flat.step_chunk(chunk, hyper, factors, state, skips.get(chunk.param.device))
    for hook in list(inner._optimizer_step_post_hooks.values()):
        hook(inner, (), {})
