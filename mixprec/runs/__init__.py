"""Run folders: claiming one (lock, unique name), the metrics files and events written while
training, checkpoints and the :class:`Checkpointer` that saves and restores a whole run, and
:func:`read_run`, the one way back in (reports and comparisons read only this)."""
from mixprec.runs.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from mixprec.runs.checkpointer import Checkpointer, Restored
from mixprec.runs.events import RunEvents
from mixprec.runs.metrics import MetricsLogger, read_events, read_metrics, read_numerics
from mixprec.runs.read import read_run, read_run_config
from mixprec.runs.run_dir import claim_run_dir, default_run_dir_name

__all__ = [
    # the folder
    "claim_run_dir", "default_run_dir_name",
    # written while training
    "MetricsLogger", "RunEvents",
    # checkpoints
    "save_checkpoint", "load_checkpoint", "list_checkpoints", "Checkpointer", "Restored",
    # reading a run back
    "read_run", "read_run_config", "read_metrics", "read_numerics", "read_events",
]
