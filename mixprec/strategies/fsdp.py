"""`FSDPStrategy`: parameters, gradients and optimizer state sharded across ranks (FSDP2).

``torch.distributed.fsdp.fully_shard`` turns each chosen module into a unit whose parameters are
``DTensor`` shards: before a unit's forward (and again before its backward, when
``reshard_after_forward``) the shards are all-gathered; after its backward the gradients are
reduce-scattered. Each transformer block (each child of an ``nn.ModuleList``; for a bare
``nn.Sequential``, each child with parameters) becomes a unit, then the root takes what is left.

How our :class:`~mixprec.precision.Policy` maps onto FSDP2's ``MixedPrecisionPolicy``:

========================  ===============================  ==================================
Policy                    FSDP2                            Meaning
========================  ===============================  ==================================
compute_dtype below FP32  ``param_dtype = compute_dtype``  shards are all-gathered and used in
                                                           the compute dtype (half the bytes)
param_dtype below FP32,   ``param_dtype = param_dtype``    the same: the FP32 *sharded* params
master_weights=True                                        are the master weights; do not wrap
                                                           the optimizer in MasterWeights
param_dtype below FP32,   model cast to ``param_dtype``    pure low-precision training
master_weights=False      before sharding
reduce_dtype              ``reduce_dtype``                 dtype of the reduce-scatter (FSDP2
                                                           would otherwise reduce in
                                                           ``param_dtype``)
keeps_fp32 modules        own unit, ``param_dtype=FP32``,  FP32 islands: inputs cast up, output
(norms, gates)            ``output_dtype = compute``       cast back to the compute dtype
========================  ===============================  ==================================

So for ``bf16-mixed`` the optimizer steps on FP32 shards, forward/backward run on BF16 copies, and
gradients are reduced in FP32. Run the forward under ``mixprec.autocast(policy)`` as usual: ops
outside FSDP's module boundaries (functional code in the root) still need it.

Runs on CPU with gloo (checked with torch 2.13) as well as on CUDA with NCCL.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from mixprec.errors import CheckpointError, ConfigError
from mixprec.optim import moments as M
from mixprec.precision import Policy, Precision, setup_identity
from mixprec.precision.plugins import Fsdp2Plugin
from mixprec.strategies.base import OptimizerLike, ProcessGroupStrategy, Strategy

__all__ = ["FSDPStrategy", "fsdp_mixed_precision", "default_shard_units"]

_F32 = torch.float32


def fsdp_mixed_precision(policy: Precision | Policy | str | None) -> MixedPrecisionPolicy:
    """FSDP2's policy for the ordinary units of a model trained under ``policy`` (table above;
    decided by the FSDP2 plugin, :meth:`mixprec.precision.plugins.Fsdp2Plugin.mixed_precision`)."""
    if policy is None:
        return MixedPrecisionPolicy()
    precision = policy if isinstance(policy, Precision) else Precision(policy)
    return Fsdp2Plugin(precision.recipe).mixed_precision()


def default_shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules that become their own FSDP unit: every child of every outermost ModuleList
    (transformer blocks); for an ``nn.Sequential`` root without ModuleLists, each child that has
    parameters. The root is not included (it is always sharded last)."""
    units: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and id(module) not in inside:
            for sub in module.modules():
                inside.add(id(sub))
            units.extend(child for child in module if any(True for _ in child.parameters()))
    if not units and isinstance(model, nn.Sequential):
        units = [c for c in model if any(True for _ in c.parameters())]
    return units


class FSDPStrategy(ProcessGroupStrategy, Strategy):
    """Fully sharded data parallelism with FSDP2 ``fully_shard``.

    Args:
        policy: a :class:`~mixprec.Precision`, :class:`Policy` or preset name; also settable
            through ``setup(precision=...)``.
        reshard_after_forward: free gathered params after forward (re-gather in backward):
            less memory, one more all-gather per unit.
        shard_units: ``model -> modules`` choosing FSDP units (default :func:`default_shard_units`).
        backend, timeout, device: as for :class:`~mixprec.strategies.MirroredStrategy`.
    """

    name = "fsdp"

    def __init__(self, policy: Precision | Policy | str | None = None, *, reshard_after_forward: bool = True,
                 shard_units: Callable[[nn.Module], list[nn.Module]] | None = None,
                 backend: str | None = None, timeout: float | None = None,
                 device: torch.device | str | None = None) -> None:
        env, dev = self._init_distributed(device=device, backend=backend, timeout=timeout)
        Strategy.__init__(self, device=dev, rank=env.rank, local_rank=env.local_rank,
                          world_size=env.world_size)
        self._use_precision(policy, None)
        self.reshard_after_forward = reshard_after_forward
        self.shard_units = shard_units or default_shard_units

    # --- wrapping -----------------------------------------------------------------------------

    @property
    def shards_parameters(self) -> bool:
        return self.is_distributed

    def setup(self, model: nn.Module, optimizer: OptimizerLike = None, *,
              precision: Precision | Policy | str | None = None,
              policy: Policy | str | None = None) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """Shard ``model``; rebuild ``optimizer`` on the sharded parameters.

        ``fully_shard`` replaces every parameter with a DTensor shard, so an optimizer built
        before ``setup`` would step tensors the model no longer uses. A ``torch.optim`` optimizer
        without state is rebuilt with the same class, groups and hyper-parameters; otherwise pass
        a factory ``params -> optimizer`` or build the optimizer after ``setup``.
        """
        self._use_precision(precision, policy)
        names = {id(p): n for n, p in model.named_parameters()}
        groups = None
        if isinstance(optimizer, torch.optim.Optimizer) and type(optimizer).__module__.startswith("torch.optim"):
            if optimizer.state:
                raise ConfigError("FSDPStrategy.setup got an optimizer that has already stepped; "
                                  "build the optimizer after setup() or pass a factory")
            groups = [{**{k: v for k, v in g.items() if k != "params"},
                       "params": [names[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
        elif optimizer is not None and not callable(optimizer):
            raise ConfigError(f"FSDPStrategy cannot rebuild a {type(optimizer).__name__} on sharded "
                              "parameters; pass a factory (lambda params: ...) or build it after "
                              "setup(); FSDP's FP32 shards already are master weights")
        sharded = self._wrap(model.to(self.device))
        if groups is not None:
            params = dict(sharded.named_parameters())
            new_groups = [{**g, "params": [params[n] for n in g["params"]]} for g in groups]
            return sharded, type(optimizer)(new_groups, **optimizer.defaults)
        return sharded, self._make_optimizer(sharded, optimizer)

    def _wrap(self, model: nn.Module) -> nn.Module:
        if not self.is_distributed or isinstance(model, FSDPModule):
            return model
        precision = self.precision
        if precision is not None and setup_identity(model) is None:
            # FSDPStrategy used on its own (fit() and a hand loop set the model up first): the
            # one set-up, sharded (casts only modes without masters).
            precision.setup_module(model, sharded=True)
        self._broadcast_from_main(model)
        mp = fsdp_mixed_precision(precision)
        islands: set[str] = set()   # parameter names (fully_shard replaces the tensors)
        island = Fsdp2Plugin(precision.recipe).island_policy() if precision is not None else None
        if island is not None:
            table = precision.layers.table if precision.layers.table is not None else precision.resolve(model)
            for qname in table.islands:   # the FP32 islands of the table Precision.setup produced
                if not qname:
                    continue                                 # the root is sharded last, below
                module = model.get_submodule(qname)
                islands.update(f"{qname}.{n}" for n, _ in module.named_parameters())
                fully_shard(module, mp_policy=island, reshard_after_forward=self.reshard_after_forward)
        for unit in self.shard_units(model):
            fully_shard(unit, mp_policy=mp, reshard_after_forward=self.reshard_after_forward)
        fully_shard(model, mp_policy=mp, reshard_after_forward=self.reshard_after_forward)
        self._per_step = self._payloads(model, mp, islands)
        return model

    def _payloads(self, model: nn.Module, mp: MixedPrecisionPolicy,
                  islands: set[str]) -> dict[str, float]:
        gather = reduce = 0
        for name, p in model.named_parameters():
            n = p.numel()  # full (global) size of the DTensor
            g_dtype = _F32 if name in islands else (mp.param_dtype or p.dtype)
            gather += n * g_dtype.itemsize
            reduce += n * (mp.reduce_dtype or g_dtype).itemsize
        passes = 2 if self.reshard_after_forward else 1
        return {"allgather_bytes_per_step": float(gather * passes),
                "reduce_scatter_bytes_per_step": float(reduce)}

    @staticmethod
    def _broadcast_from_main(model: nn.Module) -> None:
        """Give every rank rank 0's initial weights (each rank keeps its slice of its own copy)."""
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=0)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Skip the reduce-scatter on accumulation micro-steps (unsharded grads accumulate)."""
        if not isinstance(model, FSDPModule):
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def _no_sync():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        return _no_sync()

    # --- checkpoints --------------------------------------------------------------------------

    _FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
    _LOAD = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full FP32 state on CPU, gathered shard by shard; complete on rank 0, empty elsewhere."""
        if not self.is_distributed:
            return super().model_state_dict(model)
        return get_model_state_dict(model, options=self._FULL)

    def load_model_state_dict(self, model: nn.Module, state: Mapping[str, torch.Tensor] | None) -> None:
        """Rank 0's full state is broadcast and each rank keeps its shard; others may pass None."""
        if not self.is_distributed:
            return super().load_model_state_dict(model, state)
        set_model_state_dict(model, dict(state) if self.rank == 0 else {}, options=self._LOAD)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Full state on CPU keyed by parameter name (complete on rank 0): DTensor states (FP32
        moments, and 8-bit moments' codes and scales, sharded like the parameter) are gathered,
        so the file is the same at every world size. In one process: the optimizer's own."""
        if not self.is_distributed:
            return super().optimizer_state_dict(model, optimizer)
        return _fp8_codes(get_optimizer_state_dict(model, optimizer, options=self._FULL))

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: Mapping | None) -> None:
        """Each rank keeps its rows of every state tensor, whatever the world size it was saved
        at: a name-keyed state (saved sharded) also loads in one process, an index-keyed one
        (saved in one process) also loads sharded."""
        if not self.is_distributed:
            return super().load_optimizer_state_dict(model, optimizer, _by_index(model, optimizer, state))
        if self.rank == 0:
            state = _fp8_bytes(_by_name(model, optimizer, state))
        set_optimizer_state_dict(model, optimizer, dict(state) if self.rank == 0 else {},
                                 options=self._LOAD)

    def comm_stats(self) -> dict[str, float]:
        """Analytic per-step payloads of the sharded model (FSDP2 exposes no byte counter):
        ``allgather_bytes_per_step`` (forward, plus backward when resharding) and
        ``reduce_scatter_bytes_per_step``, as full unsharded sizes per rank."""
        stats = super().comm_stats()
        stats.update(getattr(self, "_per_step", {}))
        return stats


def _names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Every name of each optimizer slot's parameter (tied weights have several; the first is the
    one FSDP2's gathered state uses), in the optimizer's index order."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(f"{type(optimizer).__name__} steps tensors that are not the model's "
                                      "parameters (FP32 master copies?); a checkpoint moves between world "
                                      "sizes only for an optimizer on the parameters themselves")
            out.append(names[id(p)])
    return out


def _rekey(state: Mapping, key: Callable[[Any], Any]) -> dict:
    return {**state, "state": {key(k): v for k, v in state["state"].items()},
            "param_groups": [{**g, "params": [key(k) for k in g["params"]]} for g in state["param_groups"]]}


def _by_index(model: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping | None) -> Mapping | None:
    """A name-keyed (gathered FSDP2) optimizer state keyed by index for ``optimizer.load_state_dict``."""
    if state is None or not any(isinstance(k, str) for g in state["param_groups"] for k in g["params"]):
        return state
    index = {n: i for i, aliases in enumerate(_names(model, optimizer)) for n in aliases}
    missing = [k for g in state["param_groups"] for k in g["params"] if k not in index]
    if missing:
        raise CheckpointError(f"the optimizer state names parameters this model does not have ({missing[0]}); "
                              "resume with the model it was saved with")
    return _rekey(state, index.__getitem__)


def _by_name(model: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping | None) -> Mapping | None:
    """An index-keyed (one-process) optimizer state keyed by parameter name, as FSDP2 loads it."""
    if state is None or not any(isinstance(k, int) for g in state["param_groups"] for k in g["params"]):
        return state
    names = [aliases[0] for aliases in _names(model, optimizer)]
    out = _rekey(state, names.__getitem__)
    return {"state": out["state"], "param_groups": out["param_groups"]}   # what FSDP2's loader reads


def _fp8_codes(state: Mapping) -> Mapping:
    """Gathered 8-bit moments whose FP8 codes crossed as bytes (mixprec.optim.sharded) as FP8
    codes again, read from each group's ``moments``: the file is the one-process file."""
    for group in state.get("param_groups", ()):
        for key in group["params"]:
            st = state["state"].get(key)
            if st and "moments" in group:
                M.from_bytes_(st, group["moments"])
    return state


def _fp8_bytes(state: Mapping | None) -> Mapping | None:
    """FP8 codes as their bytes for FSDP2's broadcast (gloo has no FP8 type); copies the dicts."""
    if state is None:
        return None
    return {**state, "state": {k: M.to_bytes_(dict(st)) for k, st in state["state"].items()}}
