"""The training loop: :class:`Trainer` and ``fit()``, and their configuration.

Run folders, checkpoints and metrics files moved to :mod:`mixprec.runs`, Hugging Face models and
objectives to :mod:`mixprec.models`, the learning-rate schedule to :mod:`mixprec.optim`; the old
module paths (``mixprec.train.checkpoint``, ...) keep working (docs/ARCHITECTURE.md).
"""
from mixprec import _compat
from mixprec.models import hf, objective
from mixprec.optim import schedule
from mixprec.runs import checkpoint, checkpointer, events, metrics, run_dir
from mixprec.train.config import FitConfig, TrainConfig, load_config
from mixprec.train.trainer import FitResult, StepOutput, Trainer, fit

_compat.alias(__name__, checkpoint=checkpoint, resume=checkpointer, events=events, metrics=metrics,
              run_dir=run_dir, hf=hf, objective=objective, schedule=schedule)

__all__ = ["Trainer", "fit", "FitResult", "StepOutput", "FitConfig", "TrainConfig", "load_config"]
