"""scripts/train.py with every batch read `--step_delay` seconds late (so a test can stop
a process mid-run, at a step it observes), otherwise the same command.

  python tests/scale/train_with_step_delay.py --step_delay=0.5 --config=... --workdir=...
"""

import os
import runpy
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from dspec.training import trainer  # noqa: E402

_PREFIX = '--step_delay='


def _delayed(train, delay_s: float):
  def delayed_train(task, cfg, workdir):
    get_batch = task.get_batch

    def slow_get_batch(step):
      time.sleep(delay_s)
      return get_batch(step)
    task.get_batch = slow_get_batch
    return train(task, cfg, workdir)
  return delayed_train


if __name__ == '__main__':
  delays = [a for a in sys.argv[1:] if a.startswith(_PREFIX)]
  sys.argv = [os.path.join(REPO, 'scripts', 'train.py')] + [
      a for a in sys.argv[1:] if not a.startswith(_PREFIX)]
  if delays:
    trainer.train = _delayed(trainer.train, float(delays[-1][len(_PREFIX):]))
  runpy.run_path(sys.argv[0], run_name='__main__')
