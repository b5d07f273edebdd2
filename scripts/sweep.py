"""Train one config per variant and tabulate: python scripts/sweep.py --config=configs/<x>.py.

The config's `sweep.variants` are (name, overrides) pairs and `sweep.metrics` the eval
metrics to tabulate (see dspec/training/sweep.py). Each variant trains (resumably) in
<out_dir>/<name>; results.json and results.md land in --out_dir. An --out_dir holding other
files is refused unless --force (nothing in it is deleted), and so is one inside an input of
the config.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from dspec import cli, files  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Sweep config file.',
                                          lock_config=True)
_OUT = flags.DEFINE_string('out_dir', None, 'Output directory.', required=True)
_ONLY = flags.DEFINE_list('only', [], 'Train only these variants (the table still lists '
                          'every variant that has results).')
_FORCE = flags.DEFINE_bool('force', False, 'Write into an --out_dir holding files of '
                           'something else (nothing in it is deleted).')


def main(argv):
  del argv
  from dspec.training.sweep import is_sweep_dir, markdown_table, run_sweep
  cfg = _CONFIG.value
  if 'sweep' not in cfg:
    raise ValueError('the config has no `sweep` section (variants, metrics)')
  files.check_outputs({'--out_dir': _OUT.value}, files.config_inputs(cfg),
                      force=_FORCE.value,
                      dirs={'--out_dir': lambda d: is_sweep_dir(d, cfg.sweep.variants)})
  rows = run_sweep(cfg, cfg.sweep.variants, _OUT.value, cfg.sweep.metrics, _ONLY.value)
  print(markdown_table(rows, cfg.sweep.metrics))


if __name__ == '__main__':
  cli.run(main)
