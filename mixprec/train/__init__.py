"""The training loop: :class:`Trainer` and ``fit()``, and their configuration.

Run folders, checkpoints and metrics files live in :mod:`mixprec.runs`, Hugging Face models and
objectives in :mod:`mixprec.models`, the learning-rate schedule in :mod:`mixprec.optim` (their old
paths under ``mixprec.train`` were retired in 0.4: CHANGELOG.md).
"""
from mixprec import _moved
from mixprec.train.config import FitConfig, TrainConfig, load_config
from mixprec.train.trainer import FitResult, StepOutput, Trainer, fit

__all__ = ["Trainer", "fit", "FitResult", "StepOutput", "FitConfig", "TrainConfig", "load_config"]


def __getattr__(name: str):
    _moved.refuse(__name__, name)     # ``mixprec.train.checkpoint`` ... (moved in 0.4)
