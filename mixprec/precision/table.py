"""The per-layer table: every decision :class:`mixprec.Precision` makes for one model, in one place.

``Precision.resolve(model)`` returns a :class:`LayerTable` with one :class:`LayerRow` per
parameter-owning module: the dtype its parameters are stored in, the format its matmuls compute
in, whether it is an FP32 island, whether its parameters get FP32 master copies, and why.
``setup`` casts from it, FSDP2's FP32 islands and ``MasterWeights`` are chosen from it, and the
audit, the memory estimator and ``mixprec plan`` read it. ``print(precision.describe(model))``
(and ``mixprec audit``) shows it.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from mixprec.policy.dtypes import dtype_name

__all__ = ["LayerRow", "LayerTable"]


@dataclass(frozen=True, kw_only=True)
class LayerRow:
    """The decisions for one parameter-owning module."""

    name: str
    """Qualified module name (``""``: the root)."""
    type: str
    """The module's class name."""
    kind: str
    """What the rule book says it is: ``norm``, ``gate``, ``head``, ``embedding``, ``linear``, ``other``."""
    params: int
    """Number of elements of its own parameters."""
    storage: torch.dtype
    """Dtype its own floating parameters are stored in."""
    compute: str
    """Format its matmuls run in: ``fp32``, ``bf16``, ``fp16``, ``fp8-<recipe>``."""
    fp32_island: bool
    """Its parameters stay FP32 whatever the mode (FSDP2 gives it its own FP32 unit)."""
    master: bool
    """Its parameters are updated through FP32 master copies."""
    why: str
    """The reasons, for a reader."""
    per_layer: bool = False
    """It takes a per-layer compute format (the rule book's ``is_gemm_layer``: a Linear or a
    Hugging Face ``Conv1D``)."""
    refused: str = ""
    """Why the FP8 or block-scaled format it asks for is refused: the FP8 rules, or the micro
    conversion's own (shape, a recipe's first/last blocks) (``""``: nothing refused)."""


@dataclass(frozen=True)
class LayerTable:
    """One row per parameter-owning module, in ``named_modules`` order."""

    precision: str
    rows: tuple[LayerRow, ...]

    def __iter__(self) -> Iterator[LayerRow]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, name: str) -> LayerRow:
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(name)

    @property
    def islands(self) -> list[str]:
        """Names of the modules kept in FP32."""
        return [r.name for r in self.rows if r.fp32_island]

    @property
    def plannable(self) -> dict[str, str]:
        """Layers a planner may choose a format for (``mixprec plan``, ``what_if``): those that
        take a per-layer format and are not kept in FP32 -> the format each computes in."""
        return {r.name: r.compute for r in self.rows if r.per_layer and not r.fp32_island}

    @property
    def kept_fp32(self) -> dict[str, str]:
        """Layers that would take a per-layer format but are kept in FP32 -> why (a gate, a
        ``keep_in_fp32`` tag, ``keep_fp32_names``, a per-layer ``fp32``): no planner touches them."""
        return {r.name: r.why for r in self.rows if r.per_layer and r.fp32_island}

    def __str__(self) -> str:
        head = ("module", "type", "kind", "params", "storage", "compute", "fp32", "master", "why")
        lines = [(r.name or "(root)", r.type, r.kind, f"{r.params:,}", dtype_name(r.storage), r.compute,
                  "yes" if r.fp32_island else "-", "yes" if r.master else "-", r.why) for r in self.rows]
        width = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h)
                 for i, h in enumerate(head)]
        fmt = "  ".join(f"{{:<{w}}}" for w in width[:-1]) + "  {}"
        out = [f"precision {self.precision}: {len(self.rows)} modules with parameters",
               fmt.format(*head)]
        out += [fmt.format(*line) for line in lines]
        return "\n".join(out)
