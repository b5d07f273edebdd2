"""Objective registry: maps `training.task` to the builder of its TrainTask (the drafter
tasks from their kinds' registrations in `dspec.drafter_kinds`)."""

from __future__ import annotations

from dspec import checkpoint, config_checks
from dspec.drafter_kinds import KINDS, resolve
from dspec.errors import UserError
from dspec.training import trainer

# Tasks that train a target (mtp_joint: with its MTP depths); they load their own init_from.
_TARGET_TASKS = {'target': 'target_lm:build_task', 'mtp_joint': 'mtp_task:build_joint_task'}
# The checkpoint kind each drafter task trains (and exports), for `training.init_from`.
DRAFTER_KINDS = {task: kind.name for kind in KINDS for task in kind.tasks}
# Drafters built on another's backbone: `init_from` may name an export of that kind, whose
# params they take while their own heads start fresh.
BACKBONE_KINDS = {kind.name: kind.backbone for kind in KINDS if kind.backbone}


def _builders() -> dict:
  """`training.task` -> its `build_task(cfg, workdir)` (imported here, when training)."""
  tasks = dict(_TARGET_TASKS, **{task: build for kind in KINDS
                                 for task, build in kind.tasks.items()})
  return {task: resolve(build, 'dspec.training') for task, build in tasks.items()}


def warm_start_drafter(task: trainer.TrainTask, tcfg) -> None:
  """Drafter tasks with `training.init_from`: the drafter starts from that export (a dspec
  checkpoint of the task's kind and shapes, e.g. a committed `<workdir>/export`); with
  `continue_from_init` the trainer also continues at its step. DFlash-2 and DSpark also
  start from a DFlash export: its backbone, their heads fresh. Target tasks load their own
  `init_from` (the target to start from)."""
  path, kind = tcfg.get('init_from'), DRAFTER_KINDS.get(tcfg.task)
  if not path or kind is None:
    return
  try:
    stored_kind = checkpoint.read_model_kind(path)
    if stored_kind != kind and stored_kind == BACKBONE_KINDS.get(kind):
      fresh = checkpoint.load_backbone_state(path, task.model, stored_kind)
    else:
      checkpoint.load_model_state(path, task.model, kind)
      return
  except (checkpoint.CheckpointError, FileNotFoundError, ValueError) as e:
    raise UserError(f'training.init_from={path}: cannot start the {tcfg.task} drafter from '
                    f'it: {e}') from e
  if tcfg.get('continue_from_init'):
    raise UserError(f'training.continue_from_init=True: {path} is a {stored_kind} backbone, '
                    f'not a {kind} run to continue')
  print(f'[dspec] {tcfg.task}: starts from the {stored_kind} backbone at {path}; '
        f'{len(fresh)} params start fresh', flush=True)


def run_training(cfg, workdir: str) -> dict:
  """Checks the config, locks `workdir`, builds the task and trains (or resumes)."""
  builders = _builders()
  if cfg.training.task not in builders:
    raise ValueError(f'unknown training.task {cfg.training.task!r}; '
                     f'known: {sorted(builders)}')
  config_checks.check_training_config(cfg.training)
  with trainer.workdir_lock(workdir):
    task = builders[cfg.training.task](cfg, workdir)
    warm_start_drafter(task, cfg.training)
    return trainer.train(task, cfg.training, workdir)
