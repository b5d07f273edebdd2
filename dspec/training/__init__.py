"""Training: the resumable train loop, the objectives by `training.task`, self-distilled
data and sweeps."""

from dspec.training.distill import load_distilled, split_distilled
from dspec.training.sweep import markdown_table, run_sweep
from dspec.training.tasks import run_training
from dspec.training.trainer import TrainingDiverged, TrainTask, train

__all__ = ['TrainTask', 'TrainingDiverged', 'load_distilled', 'markdown_table',
           'run_sweep', 'run_training', 'split_distilled', 'train']
