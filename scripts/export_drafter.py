"""Export a DFlash / DFlash-2 drafter in z-lab form (config.json + model.safetensors).

  python scripts/export_drafter.py --path=demo/dflash --out=/tmp/dflash_zlab \
      [--dtype=bfloat16] [--force]

--path is a dspec checkpoint (kind 'dflash' or 'dflash2') or any drafter directory dspec
reads (z-lab, speculators). The export loads in z-lab's package
(`dflash.DFlashDraftModel` / `DFlash2DraftModel.from_pretrained`), so it runs in z-lab's
loop and in engines that read that format. Drafters z-lab cannot express (a reduced draft
vocabulary, dspec's anchor-relative window) are refused. Bad input prints one
`error: ...` line and exits with status 1.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags, logging  # noqa: E402

from dspec import cli  # noqa: E402

_PATH = flags.DEFINE_string('path', None, 'Drafter to export.', required=True)
_OUT = flags.DEFINE_string('out', None, 'Directory to write.', required=True)
_DTYPE = flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'],
                           'Dtype of the exported tensors.')
_FORCE = flags.DEFINE_boolean('force', False, 'Write into a non-empty --out directory.')


def main(argv):
  del argv
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  out = _OUT.value
  if os.path.isdir(out) and os.listdir(out) and not _FORCE.value:
    raise cli.UserError(f'{out}: directory is not empty (pass --force to write into it)')
  from dspec.models import drafter_formats  # heavy imports after flag parsing
  drafter = drafter_formats.load(_PATH.value)
  drafter_formats.save_zlab(out, drafter, dtype=_DTYPE.value)
  print(f'wrote {out}: {drafter.checkpoint_kind} drafter, {drafter.cfg.num_layers} layers, '
        f'block {drafter.cfg.block_size}, taps {list(drafter.cfg.target_layer_ids)} '
        f'({_DTYPE.value})')


if __name__ == '__main__':
  cli.run(main)
