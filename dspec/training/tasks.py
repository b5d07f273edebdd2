"""Objective registry: maps `training.task` to the builder of its TrainTask."""

from __future__ import annotations

from dspec import config_checks, files
from dspec.training import trainer


def _builders():
  from dspec.training import dflash_task, dspark_task, eagle3_task, mtp_task, target_lm
  return {'target': target_lm.build_task, 'dflash': dflash_task.build_task,
          'dflash2': dflash_task.build_task, 'bd3lm': dflash_task.build_task,
          'dspark': dspark_task.build_task, 'eagle3': eagle3_task.build_task,
          'mtp_joint': mtp_task.build_joint_task, 'mtp_posthoc': mtp_task.build_posthoc_task}


def run_training(cfg, workdir: str) -> dict:
  """Checks the config, locks `workdir`, builds the task and trains (or resumes)."""
  builders = _builders()
  if cfg.training.task not in builders:
    raise ValueError(f'unknown training.task {cfg.training.task!r}; '
                     f'known: {sorted(builders)}')
  config_checks.check_training_config(cfg.training)
  with files.directory_lock(workdir, 'trainer'):
    task = builders[cfg.training.task](cfg, workdir)
    return trainer.train(task, cfg.training, workdir)
