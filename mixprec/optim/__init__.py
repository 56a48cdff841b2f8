"""Optimizer-side mechanics: FP32 master weights of low-precision parameters, AdamW with low-bit
moments, the overlapped per-module update and the learning-rate schedule.

One optimizer class per storage layout, each whole in its own file, single inheritance:
``MasterWeights`` (master.py) wraps any ``torch.optim`` optimizer with full FP32 masters;
``SplitMasterWeights`` (split_masters.py), which ``MasterWeights(...)`` builds wherever it is exact,
stores the masters of BF16 params as the param + a 16-bit remainder; ``AdamW`` (adamw.py) adds
``fp16_params=True`` (convert an FP32 model in place and keep masters) and BF16 / 8-bit moments.
All expose ``master_grads()``, the grad protocol ``mixprec.amp.GradScaler`` uses to unscale into
the FP32 master grads (docs/CONTRACTS.md), and take ``step(inputs=StepInputs(found_inf=...))`` to skip a non-finite step on the device. Their
step is a fixed number of fused ops on flat chunks (mixprec.optim.flat).
"""
from mixprec.optim.adamw import AdamW
from mixprec.optim.inputs import StepInputs
from mixprec.optim.master import MasterWeights
from mixprec.optim.overlap import OverlappedUpdate
from mixprec.optim.schedule import WarmupCosine, warmup_cosine_scheduler
from mixprec.optim.split_masters import SplitMasterWeights

__all__ = [
    "AdamW",
    "MasterWeights", "SplitMasterWeights", "StepInputs",
    "OverlappedUpdate",
    "WarmupCosine", "warmup_cosine_scheduler",
]
