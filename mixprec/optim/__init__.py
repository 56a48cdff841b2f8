"""Optimizer-side mechanics: FP32 master weights of low-precision parameters, AdamW with low-bit
moments, the overlapped per-module update and the learning-rate schedule.

``MasterWeights`` wraps any ``torch.optim`` optimizer; ``AdamW`` adds ``fp16_params=True`` (convert
an FP32 model in place and keep masters) and BF16 moments. Both expose ``master_grads()``, the grad
protocol ``mixprec.amp.GradScaler`` uses to unscale into the FP32 master grads (docs/CONTRACTS.md),
and take ``step(inputs=StepInputs(found_inf=...))`` to skip a non-finite step on the device. Their
step is a fixed number of fused ops on flat chunks (mixprec.optim.flat).
"""
from mixprec.optim.adamw import AdamW
from mixprec.optim.inputs import StepInputs
from mixprec.optim.master import MasterWeights
from mixprec.optim.overlap import OverlappedUpdate
from mixprec.optim.schedule import WarmupCosine, warmup_cosine_scheduler

__all__ = [
    "AdamW",
    "MasterWeights", "StepInputs",
    "OverlappedUpdate",
    "WarmupCosine", "warmup_cosine_scheduler",
]
