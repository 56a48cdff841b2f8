"""FP8-stored activations: what Linear layers save for backward, kept in FP8 E4M3 per block.

A Linear saves its input for the weight gradient (``dW = dy^T x``). In a Transformer block those
inputs (the two norm outputs, the attention output's ``(B, T, C)`` copy, the GELU output) are
``(3 + r) * d`` of the ``~(7 + 2r) * d`` values a block keeps per token in the compute dtype. With
:func:`store_activations_in_fp8` each of them is stored as ``float8_e4m3fn`` codes with one FP32
scale per ``block`` consecutive values (the block's absolute maximum over 448) and widened back
to its dtype when backward needs it: 1 + 4 / block bytes per value instead of 2 (BF16) or 4.

What is and is not stored in FP8 (stated, tested): inside the forward of a chosen module every
tensor autograd saves is packed, except the module's own parameters and tensors shaped like one
of them or like their transpose (the weight copy autocast makes), tensors that are not floating point, and small ones
(``min_numel``). By default the chosen modules are ``nn.Linear`` (and mixprec's FP8/format
Linears, which subclass it); ``module_filter_fn`` can add activations (``nn.GELU`` saves its
input) or norms. The forward is unchanged (the FP8 copy is only for backward), so only gradients
see the rounding: the weight gradient of each Linear is computed from an input rounded to E4M3
(3 mantissa bits, relative error <= 2**-4 per value).

Activation checkpointing: a checkpointed block saves nothing but its input during the forward
and recomputes the rest in backward; the hooks here stand aside inside a checkpointed region
(torch's non-reentrant checkpoint owns those saved tensors; more generally the hooks do nothing
while other saved-tensor hooks are active), so the two compose and checkpointing alone decides
those blocks' memory; layers outside checkpointed blocks (the head) still store FP8.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mixprec.errors import ConfigError

__all__ = ["Fp8ActivationStore", "store_activations_in_fp8"]

_E4M3_MAX = 448.0
_BLOCK = 128
BYTES_PER_VALUE = 1 + 4 / _BLOCK
"""Bytes per stored value with the default block (E4M3 code + its share of the FP32 scale)."""


@dataclass(frozen=True)
class _Packed:
    codes: Tensor          # float8_e4m3fn, flat, padded to whole blocks
    scales: Tensor         # FP32 per block
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


def _pack(t: Tensor, block: int) -> _Packed:
    flat = t.detach().reshape(-1).float()
    n = flat.numel()
    pad = (-n) % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    blocks = flat.view(-1, block)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / _E4M3_MAX, torch.ones_like(amax))
    codes = (blocks / scale).to(torch.float8_e4m3fn)
    return _Packed(codes, scale, t.shape, t.stride(), t.dtype)


def _unpack(p: _Packed) -> Tensor:
    n = p.shape.numel()
    vals = (p.codes.float() * p.scales).view(-1)[:n].to(p.dtype)
    return vals.view(p.shape)


def _other_hooks_active() -> bool:
    """Whether some other saved-tensor hooks are active (torch's non-reentrant activation
    checkpoint records or recomputes with its own; so does CPU offloading): then stand aside."""
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    except AttributeError:  # pragma: no cover - other torch versions
        return False


class Fp8ActivationStore:
    """The hooks :func:`store_activations_in_fp8` installed; ``remove()`` takes them off.

    ``packed`` / ``packed_bytes`` / ``original_bytes`` count what was stored since the last
    :meth:`reset_counts` (for tests and the memory estimate)."""

    def __init__(self, modules: list[nn.Module], *, block: int, min_numel: int) -> None:
        self.block, self.min_numel = block, min_numel
        self.modules = modules
        self.packed = 0
        self.packed_bytes = 0
        self.original_bytes = 0
        self._handles = []
        self._contexts: list[torch.autograd.graph.saved_tensors_hooks | None] = []
        for m in modules:
            self._handles.append(m.register_forward_pre_hook(self._enter(m)))
            self._handles.append(m.register_forward_hook(self._exit, always_call=True))

    def _enter(self, module: nn.Module) -> Callable:
        skip_ptrs = {p.data_ptr() for p in module.parameters(recurse=False)}
        skip_shapes = {s for p in module.parameters(recurse=False) for s in (tuple(p.shape), tuple(p.shape)[::-1])}

        def pack(t: Tensor):
            if (not t.is_floating_point() or t.numel() < self.min_numel or isinstance(t, nn.Parameter)
                    or t.data_ptr() in skip_ptrs or tuple(t.shape) in skip_shapes
                    or t.dtype == torch.float8_e4m3fn):
                return t
            p = _pack(t, self.block)
            self.packed += 1
            self.original_bytes += t.numel() * t.element_size()
            self.packed_bytes += p.codes.numel() + 4 * p.scales.numel()
            return p

        def unpack(x):
            return _unpack(x) if isinstance(x, _Packed) else x

        def pre_hook(mod, args):
            if not torch.is_grad_enabled() or _other_hooks_active():
                self._contexts.append(None)
                return
            ctx = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
            ctx.__enter__()
            self._contexts.append(ctx)
        return pre_hook

    def _exit(self, module, args, output):
        ctx = self._contexts.pop() if self._contexts else None
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def reset_counts(self) -> None:
        self.packed = self.packed_bytes = self.original_bytes = 0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def store_activations_in_fp8(model: nn.Module, *, block: int = _BLOCK, min_numel: int = 1024,
                             module_filter_fn: Callable[[nn.Module, str], bool] | None = None
                             ) -> Fp8ActivationStore:
    """Keep the tensors that ``model``'s Linear layers save for backward in FP8 E4M3 (per-block
    FP32 scales) and widen them in backward. ``module_filter_fn(module, qualified_name)`` picks
    other modules instead (default: every ``nn.Linear``). Returns the hooks (``.remove()``)."""
    if block < 1:
        raise ConfigError(f"block must be >= 1, got {block}")
    pick = module_filter_fn or (lambda m, name: isinstance(m, nn.Linear))
    modules = [m for name, m in model.named_modules() if pick(m, name)]
    return Fp8ActivationStore(modules, block=block, min_numel=min_numel)
