"""The training loop (``fit``), its configuration, checkpoints, metrics and reports."""
from mixprec.train.config import FitConfig, TrainConfig, load_config
from mixprec.train.trainer import FitResult, StepOutput, Trainer, fit

__all__ = ["Trainer", "fit", "FitResult", "StepOutput", "FitConfig", "TrainConfig", "load_config"]
