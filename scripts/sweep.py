"""Train one config per variant and tabulate: python scripts/sweep.py --config=configs/<x>.py.

The config's `sweep.variants` are (name, overrides) pairs and `sweep.metrics` the eval
metrics to tabulate (see dspec/training/sweep.py). Each variant trains (resumably) in
<out_dir>/<name>; results.json and results.md land in --out_dir.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from dspec import cli  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Sweep config file.',
                                          lock_config=True)
_OUT = flags.DEFINE_string('out_dir', None, 'Output directory.', required=True)
_ONLY = flags.DEFINE_list('only', [], 'Train only these variants (the table still lists '
                          'every variant that has results).')


def main(argv):
  del argv
  from dspec.training.sweep import markdown_table, run_sweep
  cfg = _CONFIG.value
  if 'sweep' not in cfg:
    raise ValueError('the config has no `sweep` section (variants, metrics)')
  rows = run_sweep(cfg, cfg.sweep.variants, _OUT.value, cfg.sweep.metrics, _ONLY.value)
  print(markdown_table(rows, cfg.sweep.metrics))


if __name__ == '__main__':
  cli.run(main)
