"""Estimators (arithmetic, nothing is run): memory per precision mode, and the time, energy and
cost of a training run on a cluster from the GPU table. Measurements live in :mod:`mixprec.bench`."""
from mixprec import _moved
from mixprec.estimate.cluster import Estimate, ModelSpec, estimate, format_estimates, model_from_hf_config
from mixprec.estimate.gpus import GPUS, GpuSpec, get_gpu
from mixprec.estimate.memory import MemoryEstimate, ModelShape, estimate_memory

__all__ = ["estimate_memory", "MemoryEstimate", "ModelShape", "estimate", "Estimate", "ModelSpec",
           "format_estimates", "model_from_hf_config", "GPUS", "GpuSpec", "get_gpu"]


def __getattr__(name: str):
    _moved.refuse(__name__, name)     # ``mixprec.estimate.flops`` moved to the core in 0.4
