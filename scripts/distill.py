"""Self-distillation: python scripts/distill.py --config=configs/distill_demo.py --out_dir=D.

The target writes continuations for the config's prompt sets (greedy or sampled); the
result is a sharded dataset whose loss mask marks the target-written tokens. Resumable:
rerun the same command to continue after an interruption.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from dspec import cli, config_checks, console  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Distillation config file.',
                                          lock_config=True)
_OUT_DIR = flags.DEFINE_string('out_dir', None, 'Output dataset directory.', required=True)
_FORCE = flags.DEFINE_bool('force', False, 'Write into an --out_dir that holds files other than '
                           'a distilled set (nothing in it is deleted).')


def main(argv):
  del argv
  status = console.configure()
  from dspec.training import distill
  config_checks.require_sections(_CONFIG.value, ('distill', 'model'), 'scripts/distill.py',
                                 flags.FLAGS['config'].config_filename)
  status(f'distilling into {_OUT_DIR.value} (resumes from complete shards)')
  manifest = distill.distill(_CONFIG.value, _OUT_DIR.value, force=_FORCE.value)
  print(f'distilled {manifest["num_prompts"]} prompts into {len(manifest["shards"])} shards '
        f'({manifest["num_tokens_written"]} target-written tokens) at {_OUT_DIR.value}')


if __name__ == '__main__':
  flags.mark_flag_as_required('config')
  cli.run(main)
