"""Where a chunk's update runs: the fused AdamW kernel (mixprec.optim.adamw_triton) or the twin's
own ``step()`` (mixprec.optim.flat's docstring says why a kernel at all).

:func:`kernel_refusal` says why a chunk keeps the twin (None: it takes the kernel): the device
type (:data:`KERNEL_DEVICES`), the twin's class and options, Triton, and the probe
(:func:`kernel_agrees`, once per device: the kernel must give torch's foreach AdamW's bits).
:class:`KernelChoice` asks it per chunk, keeps the answer per device in ``notes`` (one log line
when it changes) and launches the kernel as the twin's step. Triton is optional: it is imported
inside the functions that launch it, only where a chunk takes the kernel."""
from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mixprec.optim.flat_chunk import Chunk

__all__ = ["KERNEL_DEVICES", "PROBE_REL_TOL", "KernelChoice", "kernel_agrees", "kernel_refusal"]

_log = logging.getLogger(__name__)
"""The flat step's logger (docs/performance.md names it), shared by the modules of the flat step."""

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


class KernelChoice:
    """Per chunk, whether its update is the fused kernel instead of ``twin.step()``, and the
    launch. ``notes``: per device, ``"kernel"`` or why its chunks keep the twin (logged once per
    change); a CPU never takes the kernel."""

    def __init__(self, twin: torch.optim.Optimizer) -> None:
        self.twin = twin
        self.notes: dict[str, str] = {}

    def takes(self, chunk: Chunk, hyper: dict[str, Any]) -> bool:
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
        if self.notes.get(str(dev)) != note:
            self.notes[str(dev)] = note
            _log.info("mixprec flat step on %s: %s", dev, "one fused AdamW kernel per chunk" if why is None
                      else f"the twin optimizer steps each chunk ({why})")
        return why is None

    def step(self, chunk: Chunk, hyper: dict[str, Any], skip: Tensor | None) -> None:
        """The twin's step as one kernel launch: the same step counter (a CPU tensor, advanced on
        the host as the twin does; a skipped step steps it back, ``flat_skip.SkipMask.restore``),
        the same rounding noise for BF16 moments (the twin's generator, reseeded as its step does,
        two draws: exp_avg's, then exp_avg_sq's), nothing written where ``skip`` is set."""
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
