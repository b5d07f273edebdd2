"""Train a target LM or a drafter: python scripts/train.py --config=configs/<x>.py.

The config's `training.task` picks the objective (target | mtp | dflash | bd3lm); runs are
resumable: rerunning the same command continues from the latest checkpoint in --workdir. A
--workdir holding files of something else is refused unless --force.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from dspec import cli, config_checks, console, files  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Training config file.',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Output dir (default: training.workdir '
                               'or runs/<config name>).')
_FORCE = flags.DEFINE_bool('force', False, 'Train in a --workdir that holds files of something '
                           'else (nothing in it is deleted).')


def _trained_here(workdir: str) -> bool:
  """A workdir of an earlier run: its checkpoints/, final/ or export/, or a train_log.jsonl
  of steps."""
  if any(os.path.isdir(os.path.join(workdir, d)) for d in ('checkpoints', 'final', 'export')):
    return True
  try:
    with open(os.path.join(workdir, 'train_log.jsonl')) as f:
      return 'step' in json.loads(f.readline())
  except (OSError, ValueError, TypeError):
    return False


def main(argv):
  del argv
  status = console.configure()
  from dspec import distributed, sharding
  sharding.maybe_initialize_distributed(_CONFIG.value.get('distributed', False))
  from dspec.training import tasks  # heavy imports after flag parsing
  cfg = _CONFIG.value
  config_checks.require_sections(cfg, ('training', 'model'), 'scripts/train.py',
                                 flags.FLAGS['config'].config_filename)
  workdir = _WORKDIR.value or cfg.training.workdir or os.path.join(
      'runs', os.path.splitext(os.path.basename(flags.FLAGS['config'].config_filename))[0])
  distributed.on_main(lambda: files.check_outputs(
      {'--workdir': workdir}, files.config_inputs(cfg), force=_FORCE.value,
      dirs={'--workdir': _trained_here}))
  status(f'training {cfg.training.task} in {workdir} (metrics: one JSON line per '
         f'{cfg.training.log_every} steps, and {workdir}/train_log.jsonl)')
  result = tasks.run_training(cfg, workdir)
  print(f'training done: {result["steps"]} steps this run; workdir={workdir}')


if __name__ == '__main__':
  flags.mark_flag_as_required('config')
  cli.run(main)
