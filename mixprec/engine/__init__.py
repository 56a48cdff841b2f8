"""The precision engine: :class:`Precision`, the one object that turns a policy into decisions
(storage dtypes, FP32 exemptions, FP8 swap, master weights, loss scaling, what strategies need)."""
from mixprec.engine.precision import OptimizerSpec, Precision

__all__ = ["Precision", "OptimizerSpec"]
