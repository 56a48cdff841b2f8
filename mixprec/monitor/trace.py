"""Find the module where a NaN/Inf was born, by replaying one step with hooks.

A skipped step says *that* something overflowed; this module says *where*. The clean path costs
nothing: no hook is installed while training runs. When a step is skipped (or on demand), the
caller replays the same batch with the same RNG state (:func:`capture_rng_state` /
:func:`replay_rng_state`) inside :func:`locate_nonfinite`, which installs hooks on every module,
runs the step once, removes the hooks and names the origin.

What is observed, in execution order (each observation is a handful of reductions kept on the
device; one host transfer at the end resolves them all, one more reads the loss):

* forward:  every module's inputs and outputs (forward pre-/post-hooks);
* backward: the gradient w.r.t. every module's output (a tensor hook registered on the output),
  the module's *own* contribution to the gradient w.r.t. its inputs (the forward pre-hook hands
  the module an alias ``x.view_as(x)`` of each input and hooks that alias, so a residual branch's
  gradient is not mixed in), and every parameter's gradient.

Why tensor hooks and not ``register_full_backward_hook``: full backward hooks wrap outputs in a
custom autograd Function and forbid any in-place op on them, so a model with ``ReLU(inplace=True)``
raises in the replay. Tensor hooks on aliases survive in-place ops (an in-place module's own
input alias then simply reports nothing).

The origin:

* if the loss is non-finite: the first module, in forward order, whose output is non-finite while
  its inputs were finite (a child runs before its parent, so functional code in a parent between
  two children is attributed to the parent); ``<input>`` if the batch itself was non-finite;
  ``<loss>`` if every module output was finite (the loss function made it);
* otherwise: the first non-finite gradient in backward order. A non-finite input-gradient or
  parameter-gradient of module M means M's backward made it (M's output-gradient was seen finite
  before). A non-finite *output*-gradient of M seen first means the code that consumed M's output
  made it and has no alias hook of its own: the innermost enclosing module whose output-gradient
  was finite, or ``<loss>`` when none (the loss function's backward). When that enclosing module
  is the whole model, M itself is named (its ``grad_output``): the root's own code between a
  layer and the loss is a cast or a reshape, and "the model" tells nobody which layer to look at
  (a too-large loss scale overflows the head's FP16 output-gradient first).

A parameter several modules share (a head tied to the embedding) has one gradient hook, which sees
the sum of every owner's contribution after all of them ran: a non-finite one names the owner that
computed in the narrowest dtype (the head's FP16 GEMM, not the FP32 embedding's look-up) and lists
the others in ``tied_to`` (``head (tied to wte)``); the hook alone cannot tell the owners apart.

A module returning ``-inf`` on purpose (an additive attention mask module) is reported as the
origin when the loss is non-finite; keep masks inside the module that consumes them.
"""
from __future__ import annotations

import contextlib
import json
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from mixprec.policy.dtypes import dtype_name

__all__ = ["NonFiniteEvent", "RngState", "capture_rng_state", "replay_rng_state", "locate_nonfinite",
           "gather_origins"]


# --- RNG capture / replay -----------------------------------------------------------------------

@dataclass(frozen=True)
class RngState:
    """The generator states a training step consumes (dropout, random init of buffers, ...)."""

    cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...]
    python: object


def capture_rng_state() -> RngState:
    """Snapshot the CPU, every CUDA device's and Python's generators (take it *before* the step)."""
    cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else ()
    return RngState(cpu=torch.get_rng_state(), cuda=cuda, python=random.getstate())


def _restore(state: RngState) -> None:
    torch.set_rng_state(state.cpu)
    if state.cuda:
        torch.cuda.set_rng_state_all(list(state.cuda))
    random.setstate(state.python)


@contextlib.contextmanager
def replay_rng_state(state: RngState) -> Iterator[RngState]:
    """Run the block with the generators set to ``state``; put back what they were on exit.

    So a replay draws the same dropout masks as the original step, and the training run after it
    continues with exactly the random stream it would have had without the replay.
    """
    now = capture_rng_state()
    _restore(state)
    try:
        yield state
    finally:
        _restore(now)


# --- the event ----------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class NonFiniteEvent:
    """Where the first non-finite value of a step appeared."""

    module: str
    """Qualified module name; ``<input>``, ``<loss>`` when it arose outside every module."""
    direction: str
    """``forward`` or ``backward``."""
    kind: str
    """``nan`` or ``inf`` (NaN wins when both are present)."""
    dtype: str
    """Short dtype name of the tensor that became non-finite (fp16, bf16, fp32, ...)."""
    tensor: str
    """Which tensor: ``output``, ``grad_input``, ``grad_output`` or ``grad of <param>``."""
    input_absmax: float | None
    """Largest finite |x| of what flowed *into* the origin just before (activations in forward, the
    output-gradient in backward); None when nothing was observed."""
    input_absmin: float | None
    """Smallest non-zero finite |x| of the same tensors (zeros say nothing about underflow)."""
    loss_scale: float | None = None
    """Loss scale in effect during the replay, when the caller passed it."""
    step: int | None = None
    """Training step, when the caller passed it."""
    micro_batch: int | None = None
    """Index of the micro-batch (forward/backward pass) of the replay where it appeared."""
    rank: int | None = None
    """Global rank whose replay found it (set by :func:`gather_origins` in a multi-rank job)."""
    other_ranks: tuple[int, ...] = ()
    """Further ranks whose replay also found an origin (their own events are not kept)."""
    made_by: str | None = None
    """The operation that made it, when the tensor that showed it only received it: a parameter's
    gradient (``tensor``: ``grad of weight``) made by the module's ``weight-gradient GEMM`` (its
    ``dtype``: the GEMM's, FP16 under autocast, not the FP32 gradient it was cast into)."""
    tied_to: tuple[str, ...] = ()
    """For a parameter several modules share (a head tied to the embedding): the other modules
    that own it. Its gradient hook sees only the sum of every owner's contribution, so ``module``
    is the owner that computed in the narrowest dtype (the head's FP16 GEMM, not the FP32
    embedding look-up) and the message names both: ``head (tied to wte)``."""

    def message(self, step: int | None = None, scale_before: float | None = None,
                scale_after: float | None = None) -> str:
        """One log line, e.g. ``step 1234 skipped: inf first at blocks.3.mlp.fc2 (backward, fp16) —
        loss scale 65536 -> 32768``."""
        step = self.step if step is None else step
        head = f"step {step} skipped" if step is not None else "non-finite step"
        where = f"rank {self.rank}, " if self.rank is not None else ""
        made = f" {self.made_by}" if self.made_by else ""
        module = f"{self.module} (tied to {', '.join(self.tied_to)})" if self.tied_to else self.module
        line = f"{head}: {self.kind} first at {module} ({where}{self.direction}, {self.dtype}{made})"
        scale_before = self.loss_scale if scale_before is None else scale_before
        if scale_before is not None:
            line += f" — loss scale {_num(scale_before)}"
            if scale_after is not None:
                line += f" -> {_num(scale_after)}"
        if self.other_ranks:
            line += f" (also on rank {', '.join(map(str, self.other_ranks))})"
        return line

    def to_dict(self) -> dict:
        """Plain JSON-able fields plus the human ``message``."""
        d = asdict(self)
        d["other_ranks"] = list(self.other_ranks)
        d["tied_to"] = list(self.tied_to)
        d["message"] = self.message()
        return d

    def to_json(self) -> str:
        """One ``events.jsonl`` line (no trailing newline)."""
        return json.dumps(self.to_dict(), allow_nan=False)


def format_scale(x: float) -> str:
    """A loss scale as the skip lines and the progress lines both show it: exact below a million
    (``65536``, ``0.5``), else 4 significant digits (``1e+12``, ``9.766e+08``). Skip lines used to
    print every digit of an integer (``999999995904``) while progress lines said ``9.76562e+08``."""
    x = float(x)
    return str(int(x)) if x.is_integer() and abs(x) < 1e6 else f"{x:.4g}"


_num = format_scale


# --- observation ----------------------------------------------------------------------------------

def _stats(t: torch.Tensor) -> torch.Tensor:
    """(3,) float32 on t's device: [0 finite | 1 inf | 2 nan, finite absmax, non-zero finite absmin]."""
    t = t.detach()
    nan = torch.isnan(t).any()
    inf = torch.isinf(t).any()
    code = torch.where(nan, 2.0, torch.where(inf, 1.0, 0.0))
    a = t.abs().float()
    finite = torch.isfinite(a)
    amax = torch.where(finite, a, 0.0).amax() if t.numel() else a.new_zeros(())
    amin = torch.where(finite & (a > 0), a, math.inf).amin() if t.numel() else a.new_zeros(())
    return torch.stack([code.float(), amax, amin])


def _floats(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def in_backward() -> bool:
    """True while the autograd engine runs a backward node (e.g. an activation recompute)."""
    return torch._C._current_autograd_node() is not None


class _Recorder:
    """Collects observations as device tensors; resolves them with one host transfer."""

    def __init__(self) -> None:
        # obs, dir, kind, module, tensor, dtype, micro-batch
        self.rows: list[tuple[int, str, str, str, str, torch.dtype, int]] = []
        self.stats: list[torch.Tensor] = []
        self.n_obs = 0
        self.micro = 0              # forward/backward pass (micro-batch) of the replay
        self._seen_backward = False

    def observe(self, direction: str, kind: str, module: str, tensor: str,
                tensors: list[torch.Tensor]) -> None:
        if direction == "forward":
            if in_backward():
                return  # activation recompute replays the forward inside backward: already seen
            if self._seen_backward:  # a forward after a backward: the next micro-batch
                self.micro += 1
                self._seen_backward = False
        else:
            self._seen_backward = True
        obs = self.n_obs
        self.n_obs += 1
        for t in tensors:
            self.rows.append((obs, direction, kind, module, tensor, t.dtype, self.micro))
            self.stats.append(_stats(t))

    def resolve(self) -> list[dict]:
        """Per observation: direction, kind, module, tensor, code, dtype, absmax, absmin (merged)."""
        if not self.stats:
            return []
        # one transfer per device (normally exactly one): the only host syncs of the replay
        by_device: dict[torch.device, list[int]] = {}
        for i, s in enumerate(self.stats):
            by_device.setdefault(s.device, []).append(i)
        table: list[list[float]] = [[]] * len(self.stats)
        for idx in by_device.values():
            for i, row in zip(idx, torch.stack([self.stats[i] for i in idx]).tolist()):
                table[i] = row
        out: dict[int, dict] = {}
        for (obs, direction, kind, module, tensor, dtype, micro), (code, amax, amin) in zip(self.rows, table):
            o = out.setdefault(obs, dict(obs=obs, direction=direction, kind=kind, module=module,
                                         tensor=tensor, code=0, dtype=dtype, absmax=0.0, absmin=math.inf,
                                         micro=micro))
            if code > o["code"]:
                o["code"], o["dtype"] = int(code), dtype
            o["absmax"] = max(o["absmax"], amax)
            o["absmin"] = min(o["absmin"], amin)
        return [out[k] for k in sorted(out)]


def _parent(name: str) -> str | None:
    if name == "":
        return None
    return name.rpartition(".")[0]


def _find_origin(obs: list[dict], loss_nonfinite: bool | None) -> dict | None:
    fwd = [o for o in obs if o["direction"] == "forward"]
    if loss_nonfinite or loss_nonfinite is None:
        open_inputs: dict[str, list[dict]] = {}  # pre/post hooks nest: pair each output with its call
        root_in = None
        for o in fwd:
            if o["kind"] == "in":
                open_inputs.setdefault(o["module"], []).append(o)
                root_in = o if o["module"] == "" and root_in is None else root_in
                continue
            calls = open_inputs.get(o["module"])
            src = calls.pop() if calls else None
            if o["code"] and (src is None or not src["code"]):
                return dict(o, source=src)
        if root_in is not None and root_in["code"]:
            return dict(root_in, module="<input>", tensor="input", source=None)
        if loss_nonfinite:
            return dict(module="<loss>", direction="forward", code=2, dtype=None, tensor="output",
                        source=None)
    bwd = [o for o in obs if o["direction"] == "backward"]
    gout: dict[str, dict] = {}
    micro = None
    for o in bwd:
        if o["micro"] != micro:      # each micro-batch's backward judges its own output-gradients
            gout, micro = {}, o["micro"]
        if o["kind"] == "gout" and o["module"] not in gout:
            gout[o["module"]] = o
        if not o["code"]:
            continue
        if o["kind"] != "gout":
            return dict(o, source=gout.get(o["module"]))
        # the consumer of this module's output made it: the innermost ancestor with a finite gout
        up = _parent(o["module"])
        while up is not None:
            g = gout.get(up)
            if g is not None and not g["code"]:
                if up == "":            # the whole model: name the deepest layer, M
                    return dict(o, source=g)
                return dict(o, module=up, tensor="grad_input", source=g)
            up = _parent(up)
        return dict(o, module="<loss>", tensor="grad_output", source=None)
    return None


# --- the entry point ------------------------------------------------------------------------------

def locate_nonfinite(model: nn.Module, run_step: Callable[[], torch.Tensor | None], *,
                     loss_scale: float | None = None, step: int | None = None,
                     rng_state: RngState | None = None) -> NonFiniteEvent | None:
    """Replay one step with hooks and return where its first NaN/Inf appeared (None if clean).

    ``run_step`` does the forward *and* backward of the one batch to diagnose (e.g.
    ``lambda: scaler.scale(loss_fn(model, batch)).backward()`` — returning the loss lets the
    forward/backward decision use it) and must not step the optimizer. Pass ``rng_state`` (taken
    with :func:`capture_rng_state` before the original step) to replay the same dropout masks.

    The replay leaves the model as it found it: parameter ``.grad`` and floating buffers (e.g.
    BatchNorm running statistics) are saved before and restored after; all hooks are removed even
    when ``run_step`` raises.
    """
    rec = _Recorder()
    handles: list = []
    names = {id(m): n for n, m in model.named_modules()}

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict):
        name = names[id(module)]
        rec.observe("forward", "in", name, "input", _floats((args, kwargs)))
        if not torch.is_grad_enabled() or in_backward():
            return None

        def alias(t):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
                v = t.view_as(t)
                v.register_hook(lambda g: rec.observe("backward", "gin", name, "grad_input", [g]))
                return v
            return t
        return tree_map(alias, (args, kwargs))

    def post_hook(module: nn.Module, args: tuple, kwargs: dict, output):
        name = names[id(module)]
        outs = _floats(output)
        rec.observe("forward", "out", name, "output", outs)
        for t in outs:
            if t.requires_grad and not in_backward():
                t.register_hook(lambda g: _on_gout(name, g))

    def _on_gout(name: str, g: torch.Tensor) -> None:
        rec.observe("backward", "gout", name, "grad_output", [g])

    owners: dict[int, list[tuple[str, str]]] = {}   # a parameter's (module, name)s; 2+: tied
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(module.register_forward_hook(post_hook, with_kwargs=True))
        for pname, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            owners.setdefault(id(p), []).append((name, pname))
            if len(owners[id(p)]) == 1:       # one hook per parameter, named for its first owner
                handles.append(p.register_hook(
                    lambda g, n=name, pn=pname: rec.observe("backward", "param", n, f"grad of {pn}", [g])))

    params = [p for p in model.parameters()]
    saved_grads = [p.grad for p in params]
    saved_bufs = [(b, b.detach().clone()) for b in model.buffers() if b.is_floating_point()]
    loss = None
    try:
        for p in params:
            p.grad = None
        with replay_rng_state(rng_state) if rng_state is not None else contextlib.nullcontext():
            loss = run_step()
    finally:
        for h in handles:
            h.remove()
        for p, g in zip(params, saved_grads):
            p.grad = g
        with torch.no_grad():
            for b, copy in saved_bufs:
                b.copy_(copy)

    loss_nonfinite = None
    if isinstance(loss, torch.Tensor):
        loss_nonfinite = not bool(torch.isfinite(loss.detach()).all())
    obs = rec.resolve()
    origin = _find_origin(obs, loss_nonfinite)
    if origin is None:
        return None
    origin = _shared_owner(origin, obs, {o[0]: o for o in owners.values() if len(o) > 1})
    src = origin.get("source")
    has_src = src is not None and src["absmax"] is not None
    dtype = origin["dtype"] if origin["dtype"] is not None else (loss.dtype if isinstance(loss, torch.Tensor) else None)
    dtype, made_by = _made_by(model, origin, obs, dtype)
    return NonFiniteEvent(
        module=origin["module"] or f"<{type(model).__name__}>", direction=origin["direction"],
        kind="nan" if origin["code"] == 2 else "inf",
        dtype=dtype_name(dtype) if dtype is not None else "?",
        tensor=origin["tensor"],
        input_absmax=float(src["absmax"]) if has_src else None,
        input_absmin=(float(src["absmin"]) if has_src and math.isfinite(src["absmin"]) else None),
        loss_scale=None if loss_scale is None else float(loss_scale), step=step,
        micro_batch=origin.get("micro"), made_by=made_by, tied_to=tuple(origin.get("tied_to", ())))


def _computed_dtype(obs: list[dict], module: str) -> torch.dtype | None:
    """The dtype ``module``'s first forward output had (what it computed in), None if not seen."""
    return next((o["dtype"] for o in obs if o["direction"] == "forward" and o["kind"] == "out"
                 and o["module"] == module and o["dtype"] is not None), None)


def _shared_owner(origin: dict, obs: list[dict], shared: dict[tuple[str, str], list]) -> dict:
    """A shared (tied) parameter's gradient origin, re-attributed to the owner that made it.

    The parameter's hook fires once, on the sum of every owner's contribution, and was named for
    the first owner in module order (``wte`` before ``head``). Every owner's output-gradient was
    seen finite before it, so the inf came from an owner's own gradient op: name the owner that
    ran in the narrowest dtype (the FP16 head GEMM overflows; an FP32 embedding look-up's backward
    does not), among those that ran; on a tie keep the first owner. The others go to ``tied_to``."""
    key = (origin.get("module"), str(origin.get("tensor", ""))[len("grad of "):])
    group = shared.get(key) if origin.get("kind") == "param" else None
    if group is None:
        return origin
    ran = [(m, pn) for m, pn in group if _computed_dtype(obs, m) is not None] or group

    def bits(owner):
        dt = _computed_dtype(obs, owner[0])
        return torch.finfo(dt).bits if dt is not None and dt.is_floating_point else 64
    module, pname = min(ran, key=bits)     # min() keeps the first of equals
    source = next((o for o in obs if o["direction"] == "backward" and o["kind"] == "gout"
                   and o["module"] == module and o["micro"] == origin.get("micro")),
                  origin.get("source"))
    return dict(origin, module=module, tensor=f"grad of {pname}", source=source,
                tied_to=tuple(m for m, _ in ran if m != module))   # an owner not called added nothing


def _made_by(model: nn.Module, origin: dict, obs: list[dict],
             dtype: torch.dtype | None) -> tuple[torch.dtype | None, str | None]:
    """(the dtype, the operation) that made a parameter-gradient origin: the module's gradient
    GEMM (a weight of 2+ dims) or reduction, in the dtype the module computed its output in. Under
    autocast an FP32 parameter's gradient only receives, cast to FP32, the inf its FP16 GEMM made:
    naming FP32 sends the reader to the wrong format. Other origins: unchanged, None."""
    tensor = str(origin.get("tensor", ""))
    if origin.get("direction") != "backward" or not tensor.startswith("grad of "):
        return dtype, None
    pname = tensor[len("grad of "):]
    try:
        param = model.get_submodule(origin["module"]).get_parameter(pname)
    except (AttributeError, KeyError):
        return dtype, None
    computed = _computed_dtype(obs, origin["module"]) or dtype
    if computed is not None and dtype is not None and computed.is_floating_point \
            and torch.finfo(computed).bits < torch.finfo(dtype).bits:
        dtype = computed                  # the narrower dtype the module computed in made it
    return dtype, (f"{pname}-gradient GEMM" if param.dim() >= 2 else f"{pname}-gradient")


# --- across ranks ---------------------------------------------------------------------------------

def gather_origins(event: NonFiniteEvent | None, strategy_or_group=None) -> NonFiniteEvent | None:
    """Share each rank's traced origin of a skipped step; every rank gets the same answer.

    Under DDP only the rank whose micro-batch made the inf/NaN finds its origin in the replay,
    while rank 0 writes the logs. Call this on *every* rank of a skipped step (all ranks skip
    together, the scaler agrees on ``found_inf``): it all-gathers one small dict per rank and
    returns the event of the lowest rank that found one, with ``rank`` and ``other_ranks`` set,
    or None when no rank did. ``strategy_or_group`` is a mixprec Strategy, a process group, or None
    (the default group). Without an initialised multi-rank process group it returns ``event``.
    """
    import torch.distributed as dist
    group = strategy_or_group
    if group is not None and hasattr(group, "world_size") and hasattr(group, "rank"):
        if group.world_size <= 1:               # a Strategy of one process
            return event
        group = getattr(group, "process_group", None)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) <= 1:
        return event
    mine = None if event is None else asdict(event)
    gathered: list[dict | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    found = [(dist.get_global_rank(group, i) if group is not None else i, d)
             for i, d in enumerate(gathered) if d is not None]
    if not found:
        return None
    (rank, first), others = found[0], tuple(r for r, _ in found[1:])
    first = dict(first, rank=rank, other_ranks=others)
    return NonFiniteEvent(**first)
