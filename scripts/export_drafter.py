"""Export a learned drafter in a published form (config.json + model.safetensors).

  python scripts/export_drafter.py --path=demo/dflash --out=/tmp/dflash_zlab \
      [--format=zlab|speculators] [--dtype=bfloat16] [--force]

--path is a dspec checkpoint or any drafter directory dspec reads; its kind comes from the
checkpoint metadata (or config.json). Forms (`dspec.models.formats.DRAFTERS`):

  kind            --format        loads in
  dflash/dflash2  zlab (default)  z-lab's `dflash.DFlashDraftModel` / `DFlash2DraftModel`
                                  (`from_pretrained`), z-lab's loop, vLLM/SGLang
  dspark          speculators     speculators' `DSparkSpeculator` (+ dspec's calibration
                  (default)       as `dspec_*confidence_temperatures` keys)
  eagle3          speculators     speculators' `Eagle3DraftModel`, vLLM
                  (default)
  mtp             speculators     speculators' `MTPDraftModel`, vLLM (one shared layer:
                  (default)       a shared_depth or single-depth, full-vocabulary MTP)

Combinations without a writer (DSpark or EAGLE-3 in z-lab form, DFlash in speculators form)
and drafters a form cannot express (a reduced draft vocabulary in z-lab form, dspec's
anchor-relative window) are refused. --out is written whole or not at all: an earlier export
is replaced whole; an --out that holds files dspec did not write is refused unless --force,
which replaces a dspec checkpoint there whole and otherwise writes the two files beside the
others, refusing a directory that holds another model's files (so no directory ever holds
two drafters); --out inside --path is refused. Bad input, and a write that fails (disk
full, read-only), print one `error: ...` line and exit with status 1.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags, logging  # noqa: E402

from dspec import cli  # noqa: E402

_PATH = flags.DEFINE_string('path', None, 'Drafter to export.', required=True)
_OUT = flags.DEFINE_string('out', None, 'Directory to write.', required=True)
_FORMAT = flags.DEFINE_enum('format', None, ['zlab', 'speculators'],
                            'Form to write (default: zlab for DFlash / DFlash-2, speculators '
                            'for DSpark, EAGLE-3 and MTP).')
_DTYPE = flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'],
                           'Dtype of the exported tensors.')
_FORCE = flags.DEFINE_boolean('force', False, 'Replace a dspec checkpoint at --out whole, '
                               'or write into an --out directory holding files dspec did '
                               'not write (its config.json and model.safetensors are '
                               'replaced; nothing else is touched).')


def main(argv):
  del argv
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  from dspec import files
  from dspec.models.formats import DRAFTERS, kind_of
  from dspec.models.formats.safetensors_io import is_export
  out = _OUT.value
  files.check_outputs({'--out': out}, {'--path': _PATH.value}, force=_FORCE.value,
                      dirs={'--out': is_export})
  kind = kind_of(_PATH.value)
  if kind not in DRAFTERS:
    raise cli.UserError(f'{_PATH.value}: holds a {kind!r} model; export_drafter writes '
                        f'{", ".join(DRAFTERS)} drafters')
  writers = DRAFTERS[kind].writers
  form = _FORMAT.value or next(iter(writers))
  if form not in writers:
    raise cli.UserError(f'--format={form}: dspec writes {kind} drafters in '
                        f'{" or ".join(writers)} form only')
  drafter = DRAFTERS[kind].load(_PATH.value)
  writers[form](out, drafter, dtype=_DTYPE.value, force=_FORCE.value)
  shape = (f'{drafter.cfg.num_depths} depths' if kind == 'mtp' else
           f'{drafter.cfg.num_layers} layers, taps {list(drafter.cfg.target_layer_ids)}')
  print(f'wrote {out}: {kind} drafter in {form} form, {shape} ({_DTYPE.value})')


if __name__ == '__main__':
  cli.run(main)
