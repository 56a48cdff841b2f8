"""AdamW with FP32 master weights and, optionally, BF16 moments (as in DeepSeek-V3).

``AdamW(..., fp16_params=True)`` is the one-line recipe for a model that is entirely FP32: it
converts the model's params in place to FP16 (or ``param_dtype``), keeps FP32 masters and steps
them. With a precision ``Policy``, cast the model with ``mixprec.precision.cast_module`` instead and
leave ``fp16_params=False``: every low-precision param gets a master anyway, and params the policy
keeps in FP32 stay their own master.

``moments_dtype=torch.bfloat16`` halves the memory of ``exp_avg``/``exp_avg_sq`` (8 -> 4 bytes per
param). The update is computed in FP32 — the moments are widened into FP32 scratch buffers, updated,
used for the parameter update, and only then rounded to BF16 for storage — so each step rounds
each moment once. Rounding is **stochastic** by default: with round-to-nearest, ``exp_avg_sq``
cannot decay when the gradients shrink, because ``v * beta2`` with ``beta2 = 0.999`` moves ``v`` by
0.1 %, below half a BF16 ULP (0.39 %), so the product rounds back to ``v`` forever. Stochastic
rounding keeps every stored moment equal to its FP32 value in expectation
(docs/benchmarks/optim-bf16-moments.md has the measurement). Scratch buffers are allocated per
chunk of at most ``_CHUNK_NUMEL`` elements, so the FP32 widening never costs more than a bounded
amount of transient memory.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from mixprec.errors import ConfigError
from mixprec.optim import moments as _moments, moments_load, registry, sharded as _sharded
from mixprec.optim.master import MasterWeights
from mixprec.optim.master_args import normalise_groups
from mixprec.optim.split import CHUNK_NUMEL, chunks as _chunks
from mixprec.optim.split_masters import SplitMasterWeights

__all__ = ["AdamW", "sharded_adamw"]

_CHUNK_NUMEL = CHUNK_NUMEL  # 4 Mi elements: 16 MiB per FP32 scratch buffer (the split masters' chunks too)
_LOW_BITS_MASK = -65536  # 0xFFFF0000 as int32: keeps sign, exponent and the 7 BF16 mantissa bits


def _check_hyper(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    if not (isinstance(lr, Tensor) or lr >= 0.0):
        raise ConfigError(f"lr must be >= 0, got {lr}; pass a learning rate such as 1e-3")
    if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
        raise ConfigError(f"betas must be two numbers in [0, 1), got {betas}; the usual choice is (0.9, 0.999)")
    if not eps >= 0.0:
        raise ConfigError(f"eps must be >= 0, got {eps}; the usual choice is 1e-8")
    if not weight_decay >= 0.0:
        raise ConfigError(f"weight_decay must be >= 0, got {weight_decay}; use 0.0 to turn it off")


def _round_to_bf16_stochastic_(flat: Tensor, generator: torch.Generator | None) -> None:
    """Stochastically round an FP32 buffer in place so that its values are exactly BF16.

    Adding a uniform random 16-bit integer to the low half of the FP32 bit pattern and
    truncating it rounds the magnitude up with probability equal to the discarded fraction,
    which is unbiased. Infinities stay infinite; a finite value may round up to infinity only
    when it is within one BF16 ULP of the largest BF16 value.
    """
    bits = flat.view(torch.int32)
    noise = torch.randint(0, 1 << 16, flat.shape, dtype=torch.int32, device=flat.device, generator=generator)
    bits.add_(noise).bitwise_and_(_LOW_BITS_MASK)


class _AdamWFP32Math(torch.optim.Optimizer):
    """AdamW on FP32 params with moments stored in ``moments_dtype``, computed with foreach ops in FP32.

    Private: ``AdamW`` runs it on the FP32 masters. The state layout is torch.optim.AdamW's
    (``step`` as a CPU tensor, ``exp_avg``, ``exp_avg_sq``), so checkpoints move between the two.
    """

    mixprec_chunk_exact = True
    """Stepping chunks cut by ``mixprec.optim.split.chunks`` (its own boundaries) is exact: split
    masters step it that way."""

    mixprec_adamw_ops = True
    """Its update is torch's foreach AdamW op for op: the flat step may run it as one fused kernel
    (mixprec.optim.flat, mixprec.optim.adamw_triton)."""

    mixprec_not_separable_because = ("draws its stochastic-rounding noise per chunk of a whole param "
                                     "group, so a step split by module draws other noise (use "
                                     "stochastic_rounding=False, or FP32 moments)")

    @staticmethod
    def mixprec_separable(opt: "_AdamWFP32Math") -> bool:
        """Elementwise per parameter unless the moments are rounded stochastically (mixprec.optim.parts)."""
        return not opt.stochastic_rounding

    def __init__(self, params: Any, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 *, moments_dtype: torch.dtype, stochastic_rounding: bool, seed: int | None,
                 moments: str | None = None) -> None:
        self.moments = moments or {torch.float32: "fp32", torch.bfloat16: "bf16"}[moments_dtype]
        self.quantized = _moments.is_quantized(self.moments)
        self.shape_of: Callable[[Tensor], torch.Size] = lambda p: p.shape
        """The shape ``p`` is stepped with: what decides whether a loaded state is a matrix's (8-bit)
        or a vector's (FP32). Split masters are held empty between steps; :class:`AdamW` tells
        their parameter's shape."""
        self.moments_dtype = moments_dtype
        # int8 moments are always rounded stochastically; fp8 ones to nearest (see optim.moments).
        self.stochastic_rounding = (stochastic_rounding and moments_dtype == torch.bfloat16
                                    and not self.quantized) or self.moments == "int8"
        self._generators: dict[torch.device, torch.Generator] = {}
        if seed is None and self.stochastic_rounding:
            # Drawn from the global generator once: the run's seed decides it, and every step's
            # noise follows from it and the step (see _reseed).
            seed = int(torch.randint(0, 1 << 62, (1,)).item())
        self._seed = seed
        self._seeded_at: int | None = None
        # The format travels in every param group of a state dict: FP8 codes gathered under FSDP2
        # cross as bytes, and the group says which FP8 they are (and refuses another format's).
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "moments": self.moments})

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if self._seed is None:
            return None
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self._seed)
        return self._generators[device]

    def _reseed(self, step: int, devices: Iterable[torch.device]) -> None:
        """Start the rounding noise of optimizer step ``step`` from ``(seed, step)``: the noise is
        then a function of the step, not of the generator's history, so a resume (whose
        checkpoint may not carry the generators: FSDP2's gathered state keeps only the state and
        the groups) draws what the uninterrupted run drew. Once per step: split masters step a
        chunk at a time, and the later chunks continue the stream."""
        if self._seed is None or step == self._seeded_at:
            return
        self._seeded_at = step
        for device in devices:
            self._generator(device).manual_seed((self._seed * 1_000_003 + step) % (1 << 63))

    def state_dict(self) -> dict[str, Any]:
        """torch's, with the stochastic-rounding seed in every param group (``sr_seed``): the
        noise of every later step follows from it (see :meth:`_reseed`), so a resume rounds as the
        uninterrupted run did however this optimizer was built. In the groups, not beside them:
        FSDP2's gathered state keeps only the state and the groups."""
        sd = super().state_dict()
        if self._seed is not None:
            sd["param_groups"] = [{**g, "sr_seed": self._seed} for g in sd["param_groups"]]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = dict(state_dict)
        # Checkpoints before the noise followed from (seed, step) saved the generators; the next
        # step reseeds them (_reseed), so that is all they need.
        sd.pop("sr_generators", None)
        # The saved run's rounding seed wins over the one this optimizer drew or was given; a state
        # dict saved before the seed travelled keeps this optimizer's.
        seeds = {g["sr_seed"] for g in sd["param_groups"] if g.get("sr_seed") is not None}
        sd["param_groups"] = [{k: v for k, v in g.items() if k != "sr_seed"} for g in sd["param_groups"]]
        if seeds and self.stochastic_rounding:
            self._seed = int(min(seeds))
            self._generators.clear()
            self._seeded_at = None
        # torch casts every tensor of the state to the param dtype (FP32), 8-bit codes and 16-bit
        # scales included: note the saved dtypes and store each tensor in its own layout again.
        moments_load.check_formats((g.get("moments") for g in sd["param_groups"]), self.moments)
        saved = {i: {k: v.dtype for k, v in st.items() if isinstance(v, Tensor)} for i, st in sd["state"].items()}
        super().load_state_dict(sd)
        for g in self.param_groups:
            g["moments"] = self.moments       # what this optimizer stores from now on
        ids = dict(zip((i for g in sd["param_groups"] for i in g["params"]),
                       (p for g in self.param_groups for p in g["params"])))
        for i, dtypes in saved.items():
            p = ids.get(i)
            if p is not None and self.state.get(p):
                moments_load.restore_(self.state[p], p, dtypes, self.moments, self.moments_dtype,
                                      self.shape_of(p), self._generator)

    def new_state(self, like: Tensor) -> dict[str, Tensor]:
        """The fresh state of a parameter shaped like ``like`` (what the first step makes): 8-bit
        codes and block scales for a matrix when the moments are quantized, else zeros."""
        st: dict[str, Tensor] = {"step": torch.tensor(0.0)}
        if _moments.quantizes(like.shape, self.moments):
            st.update(_moments.new_state(like, self.moments))
        else:
            st["exp_avg"] = torch.zeros_like(like, dtype=self.moments_dtype, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(like, dtype=self.moments_dtype, memory_format=torch.preserve_format)
        return st

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        steps_before = [float(self.state[p]["step"]) for g in self.param_groups for p in g["params"]
                        if p.grad is not None and "step" in self.state[p]]
        self._reseed(int(steps_before[0]) if steps_before else 0,
                     {p.device for g in self.param_groups for p in g["params"] if p.grad is not None})
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if p.dtype != torch.float32 or p.grad.dtype != torch.float32:
                    raise ConfigError("the BF16-moment AdamW steps FP32 params only; use mixprec.optim.AdamW, "
                                      "which keeps FP32 masters of low-precision params")
                if p.grad.is_sparse:
                    raise ConfigError("AdamW does not support sparse gradients; use a dense embedding")
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    if _moments.quantizes(p.shape, self.moments):
                        st.update(_sharded.like(p, _moments.new_state(_sharded.local(p), self.moments)))
                        continue
                    st["exp_avg"] = torch.zeros_like(p, dtype=self.moments_dtype, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=self.moments_dtype, memory_format=torch.preserve_format)
            by_device: dict[torch.device, list[Tensor]] = {}
            for p in params:
                by_device.setdefault(p.device, []).append(p)
            for device, ps in by_device.items():
                for a, b in _chunks([p.numel() for p in ps], _CHUNK_NUMEL):
                    self._update(ps[a:b], group, device)
        return loss

    def _update(self, params: list[Tensor], group: dict[str, Any], device: torch.device) -> None:
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        # FSDP2's DTensor shards: the update is elementwise on each rank's local shard.
        states = [_moments.from_bytes_({k: _sharded.local(v) for k, v in self.state[p].items()}, self.moments)
                  for p in params]
        grads = [_sharded.local(p.grad) for p in params]
        params = [_sharded.local(p) for p in params]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1.0)
        # Host-side bias corrections: the steps live on the CPU (like torch's non-capturable AdamW),
        # so reading them is not a device sync.
        step_values = [float(s) for s in steps]
        bias1 = [1.0 - beta1**t for t in step_values]
        bias2_sqrt = [(1.0 - beta2**t) ** 0.5 for t in step_values]
        step_sizes = [-lr / b for b in bias1]

        # FP32 scratch: one flat buffer per moment for the chunk, viewed per param.
        numels = [p.numel() for p in params]
        m_flat = torch.empty(sum(numels), dtype=torch.float32, device=device)
        v_flat = torch.empty_like(m_flat)
        m32 = [t.view_as(p) for t, p in zip(m_flat.split(numels), params)]
        v32 = [t.view_as(p) for t, p in zip(v_flat.split(numels), params)]
        coded = [i for i, st in enumerate(states) if "exp_avg_scale" in st]   # 8-bit (optim.moments.quantizes)
        plain = [i for i, st in enumerate(states) if "exp_avg_scale" not in st]
        pick = lambda xs, idx: [xs[i] for i in idx]  # noqa: E731
        if coded:
            _moments.decode_(pick(states, coded), "exp_avg", pick(m32, coded), self.moments)
            _moments.decode_(pick(states, coded), "exp_avg_sq", pick(v32, coded), self.moments)
        if plain:
            torch._foreach_copy_(pick(m32, plain), [states[i]["exp_avg"] for i in plain])
            torch._foreach_copy_(pick(v32, plain), [states[i]["exp_avg_sq"] for i in plain])

        if wd != 0.0:
            torch._foreach_mul_(params, 1.0 - lr * wd)  # decoupled weight decay
        torch._foreach_lerp_(m32, grads, 1.0 - beta1)  # m = beta1 m + (1 - beta1) g
        torch._foreach_mul_(v32, beta2)
        torch._foreach_addcmul_(v32, grads, grads, 1.0 - beta2)  # v = beta2 v + (1 - beta2) g^2
        denom = torch._foreach_sqrt(v32)
        torch._foreach_div_(denom, bias2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, m32, denom, step_sizes)  # p -= lr / bc1 * m / denom
        del denom

        if coded:
            gen = self._generator(device)
            _moments.encode_(pick(states, coded), "exp_avg", pick(m32, coded), self.moments, gen)
            _moments.encode_(pick(states, coded), "exp_avg_sq", pick(v32, coded), self.moments, gen)
        if not plain:
            return
        if self.stochastic_rounding and not self.quantized:
            _round_to_bf16_stochastic_(m_flat, self._generator(device))
            _round_to_bf16_stochastic_(v_flat, self._generator(device))
        # exact after stochastic rounding (or FP32), nearest otherwise
        torch._foreach_copy_([states[i]["exp_avg"] for i in plain], pick(m32, plain))
        torch._foreach_copy_([states[i]["exp_avg_sq"] for i in plain], pick(v32, plain))


def sharded_adamw(params: Iterable[Tensor] | Iterable[dict[str, Any]], *, moments: str, lr: float = 1e-3,
                  betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                  seed: int | None = None) -> torch.optim.Optimizer:
    """AdamW on FSDP2's FP32 parameter shards (they are the masters) with moments stored in
    ``moments`` (``bf16``, ``int8``, ``fp8``, ``fp8-e5m2``; FP32 math): each rank updates its own
    shard, 8-bit moments are DTensors sharded like the parameter (mixprec.optim.sharded), so a
    gathered checkpoint reshards to any world size. torch.optim.AdamW's state layout."""
    _check_hyper(lr, betas, eps, weight_decay)
    if moments not in _moments.MOMENTS or moments == "fp32":
        raise ConfigError(f"sharded_adamw stores moments in bf16, int8, fp8 or fp8-e5m2, got '{moments}' "
                          "(FP32 moments: torch.optim.AdamW)")
    quantized = _moments.is_quantized(moments)
    return _AdamWFP32Math(normalise_groups(params), lr, betas, eps, weight_decay,
                          moments_dtype=torch.float32 if quantized else torch.bfloat16,
                          stochastic_rounding=True, seed=seed, moments=moments if quantized else None)


class AdamW(SplitMasterWeights):
    """AdamW with FP32 master weights of low-precision params and optional BF16 moments.

    Args:
        params: model parameters or param-group dicts (``lr``/``weight_decay``/... per group).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled weight decay).
        fp16_params: convert the given FP32 params **in place** to ``param_dtype`` after taking
            exact FP32 masters. Low-precision params always get masters, whatever this says.
        param_dtype: ``torch.float16`` (default) or ``torch.bfloat16``; used with ``fp16_params``.
        moments_dtype: ``torch.float32`` (delegates to ``torch.optim.AdamW`` on the masters, with
            ``foreach``/``fused``) or ``torch.bfloat16`` (our foreach implementation, FP32 math).
        moments: the same choice by name, plus 8-bit storage: ``"fp32"``, ``"bf16"``, ``"int8"``
            (block-wise, stochastic rounding) or ``"fp8"`` (E4M3 with per-block range expansion);
            see mixprec.optim.moments. Overrides ``moments_dtype`` when given.
        foreach, fused: passed to ``torch.optim.AdamW`` when the moments are FP32.
        stochastic_rounding: round BF16 moments stochastically (default) or to nearest.
        seed: seed of the stochastic-rounding generator (``None``: the global torch generator).
        split_masters: FP32 masters of BF16 params stored as the param plus a 16-bit remainder
            (``None``: on, the default; ``False``: full FP32 masters). Bit-identical either way;
            see mixprec.optim.master. The user's flag; ``layout`` says the same by class.
        master_params: exactly the params that get FP32 masters (the per-layer table's set,
            ``Precision.layers.master_params(model)``); ``None``: by dtype, see ``MasterWeights``.
        layout: the master layout by its class, ``MasterWeights`` (full FP32 masters) or
            ``SplitMasterWeights`` (split wherever exact), whose storage this AdamW uses as is
            (``Precision``'s params plugin passes it from ``recipe.masters``). ``None``: from
            ``split_masters``.

    With ``fp16_params=False``, FP32 params and FP32 moments this is ``torch.optim.AdamW``
    exactly (same kernels on the same tensors).

    The layout chain: a :class:`mixprec.optim.split_masters.SplitMasterWeights` (itself a
    :class:`MasterWeights`) whose inner optimizer is torch's AdamW (FP32 moments) or this file's
    FP32-math AdamW (BF16 / 8-bit moments); one class over both layouts: with
    ``layout=MasterWeights`` (or ``split_masters=False``) it holds the full layout's storage and
    steps and saves as ``MasterWeights`` does.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        fp16_params: bool = False,
        param_dtype: torch.dtype = torch.float16,
        moments_dtype: torch.dtype = torch.float32,
        foreach: bool | None = None,
        fused: bool | None = None,
        stochastic_rounding: bool = True,
        seed: int | None = None,
        split_masters: bool | None = None,
        moments: str | None = None,
        master_params: Iterable[Tensor] | None = None,
        layout: type[MasterWeights] | None = None,
    ) -> None:
        _check_hyper(lr, betas, eps, weight_decay)
        params = normalise_groups(params)
        given = [p for g in params for p in g["params"]]
        self._unmarked_vectors = (_unmarked_vectors(given), given) if fp16_params else None
        if moments is not None:
            if moments not in _moments.MOMENTS:
                raise ConfigError(f"moments must be one of {', '.join(_moments.MOMENTS)}, got '{moments}'")
            if moments in ("fp32", "bf16"):
                moments_dtype, moments = (torch.float32 if moments == "fp32" else torch.bfloat16), None
        self.moments = moments or {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(moments_dtype, "?")
        if param_dtype not in (torch.float16, torch.bfloat16):
            raise ConfigError(f"param_dtype must be torch.float16 or torch.bfloat16, got {param_dtype}")
        if moments_dtype not in (torch.float32, torch.bfloat16):
            raise ConfigError(f"moments_dtype must be torch.float32 or torch.bfloat16, got {moments_dtype} "
                              "(FP16 moments underflow: exp_avg_sq holds squared gradients)")
        self.moments_dtype = moments_dtype
        common: dict[str, Any] = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        masters: dict[str, Any] = {"param_dtype": param_dtype if fp16_params else None, "split": split_masters,
                                   "layout": layout, "master_params": master_params}
        if moments is not None:           # int8 / fp8: our FP32-math AdamW, 8-bit storage
            if fused:
                raise ConfigError(f"fused=True is torch's FP32-moment kernel; with moments={moments} leave it unset")
            super().__init__(_AdamWFP32Math, params, **masters, moments_dtype=torch.float32, moments=moments,
                             stochastic_rounding=stochastic_rounding, seed=seed, **common)
            self._tell_shapes()
            return
        if moments_dtype == torch.float32:
            super().__init__(torch.optim.AdamW, params, **masters, foreach=foreach, fused=fused, **common)
            return
        if fused:
            raise ConfigError("fused=True keeps moments in the param dtype; with moments_dtype=torch.bfloat16 "
                              "leave fused unset (the BF16-moment path always uses foreach ops)")
        super().__init__(_AdamWFP32Math, params, **masters, moments_dtype=moments_dtype,
                         stochastic_rounding=stochastic_rounding, seed=seed, **common)
        self._tell_shapes()

    def _tell_shapes(self) -> None:
        # A split master's tensor is empty between steps: its state's layout follows its parameter.
        self._inner.shape_of = lambda m: self._table.model_of.get(id(m), m).shape

    def step(self, closure: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
        if self._unmarked_vectors is not None:
            _warn_vectors_in_16_bits(*self._unmarked_vectors, self.param_dtype)
            self._unmarked_vectors = None
        return super().step(closure, **kwargs)


def _unmarked_vectors(params: list[Tensor]) -> list[Tensor]:
    """The 1-D floating parameters (norm weights, biases) ``fp16_params=True`` is about to store in
    16 bits when *nothing* marks which parameters stay FP32.

    An optimizer sees parameters, not modules: it keeps a parameter FP32 only when the decider
    recorded it so (``mixprec.optim.registry.kept_fp32``: :func:`mixprec.precision.mark_fp32_params`
    and ``mixprec.Precision.setup`` record the table's FP32 islands). A Hugging Face model has no marks, so its
    ``LlamaRMSNorm``/``LayerNorm`` weights would go to 16 bits with the matrices. They are not
    kept FP32 here behind the user's back: a 16-bit Linear fed by an FP32 norm fails in a plain
    forward (``mat1 and mat2 must have the same dtype``) unless an autocast converts the inputs.
    """
    if any(registry.kept_fp32(p) for p in params):
        return []
    return [p for p in params if p.dim() == 1 and p.dtype == torch.float32]


def _warn_vectors_in_16_bits(vectors: list[Tensor], params: list[Tensor], dtype: torch.dtype) -> None:
    """At the first step, one line if those parameters are still 16-bit and still unmarked
    (``Precision.setup`` and ``fit()`` restore and mark the norms in between: no warning then)."""
    low = [p for p in vectors if p.dtype == dtype and not registry.kept_fp32(p)]
    if not low or any(registry.kept_fp32(p) for p in params):
        return
    name, mode = ("float16", "16-true") if dtype == torch.float16 else ("bfloat16", "bf16-true")
    warnings.warn(
        f"mixprec.optim.AdamW(fp16_params=True) stores all {len(low)} one-dimensional parameters "
        f"(biases, norm weights) in {name}: nothing marks which stay FP32 and an optimizer sees "
        "parameters, not modules, so norm layers mixprec did not build (Hugging Face's "
        "LlamaRMSNorm, LayerNorm, ...) are in 16 bits too; to keep norms FP32 use "
        f"mixprec.Precision('{mode}').setup(model, optimizer) with its autocast(), as fit() does, "
        "or mixprec.precision.mark_fp32_params(model) before building the optimizer (then run the "
        "forward under autocast)", UserWarning, stacklevel=4)   # AdamW.step <- torch's wrapper <- caller
