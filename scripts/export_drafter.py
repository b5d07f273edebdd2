"""Export a learned drafter in a published form (config.json + model.safetensors).

  python scripts/export_drafter.py --path=demo/dflash --out=/tmp/dflash_zlab \
      [--format=zlab|speculators] [--dtype=bfloat16] [--force]

--path is a dspec checkpoint or any drafter directory dspec reads; its kind comes from the
checkpoint metadata (or config.json). Forms:

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
anchor-relative window) are refused. Bad input prints one `error: ...` line and exits with
status 1.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags, logging  # noqa: E402

from dspec import cli  # noqa: E402

KINDS = ('dflash', 'dflash2', 'dspark', 'eagle3', 'mtp')
FORMATS = {'dflash': ('zlab',), 'dflash2': ('zlab',), 'dspark': ('speculators',),
           'eagle3': ('speculators',), 'mtp': ('speculators',)}   # the first is the default

_PATH = flags.DEFINE_string('path', None, 'Drafter to export.', required=True)
_OUT = flags.DEFINE_string('out', None, 'Directory to write.', required=True)
_FORMAT = flags.DEFINE_enum('format', None, ['zlab', 'speculators'],
                            'Form to write (default: zlab for DFlash / DFlash-2, speculators '
                            'for DSpark, EAGLE-3 and MTP).')
_DTYPE = flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'],
                           'Dtype of the exported tensors.')
_FORCE = flags.DEFINE_boolean('force', False, 'Write into a non-empty --out directory.')


def drafter_kind(path: str) -> str:
  """dflash | dflash2 | dspark | eagle3 | mtp from dspec's checkpoint metadata, else config.json
  (speculators_model_type; a z-lab architecture; otherwise legacy EAGLE-3)."""
  from dspec import checkpoint
  from dspec.models import drafter_formats
  config = drafter_formats.read_config(path)
  if config is None:
    kind = checkpoint.read_model_kind(path)
  elif 'speculators_model_type' in config:
    kind = config['speculators_model_type']
  elif 'num_nextn_predict_layers' in config:   # HF checkpoint with DeepSeek-V3 MTP layers
    kind = 'mtp'
  else:
    archs = config.get('architectures') or []
    kind = next((drafter_formats.ZLAB_ARCHITECTURES[a] for a in archs
                 if a in drafter_formats.ZLAB_ARCHITECTURES), 'eagle3')
  if kind not in KINDS:
    raise cli.UserError(f'{path}: holds a {kind!r} model; export_drafter writes '
                        f'{", ".join(KINDS)} drafters')
  return kind


def load(kind: str, path: str):
  """The drafter model of `kind` at `path`."""
  if kind == 'dspark':
    from dspec.models import dspark
    return dspark.load_drafter(path)
  if kind == 'eagle3':
    from dspec.models import eagle3_formats
    return eagle3_formats.load(path)
  if kind == 'mtp':
    from dspec.models import mtp_formats
    return mtp_formats.load(path)
  from dspec.models import drafter_formats
  return drafter_formats.load(path)


def save(kind: str, form: str, out: str, drafter, dtype: str) -> None:
  if form == 'zlab':
    from dspec.models import drafter_formats
    drafter_formats.save_zlab(out, drafter, dtype=dtype)
  elif kind == 'dspark':
    from dspec.models import dspark
    dspark.save_speculators(out, drafter, dtype=dtype)
  elif kind == 'mtp':
    from dspec.models import mtp_formats
    mtp_formats.save_speculators(out, drafter, dtype=dtype)
  else:
    from dspec.models import eagle3_formats
    eagle3_formats.save_speculators(out, drafter, dtype=dtype)


def main(argv):
  del argv
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  out = _OUT.value
  if os.path.isdir(out) and os.listdir(out) and not _FORCE.value:
    raise cli.UserError(f'{out}: directory is not empty (pass --force to write into it)')
  kind = drafter_kind(_PATH.value)
  form = _FORMAT.value or FORMATS[kind][0]
  if form not in FORMATS[kind]:
    raise cli.UserError(f'--format={form}: dspec writes {kind} drafters in '
                        f'{" or ".join(FORMATS[kind])} form only')
  drafter = load(kind, _PATH.value)
  save(kind, form, out, drafter, _DTYPE.value)
  shape = (f'{drafter.cfg.num_depths} depths' if kind == 'mtp' else
           f'{drafter.cfg.num_layers} layers, taps {list(drafter.cfg.target_layer_ids)}')
  print(f'wrote {out}: {kind} drafter in {form} form, {shape} ({_DTYPE.value})')


if __name__ == '__main__':
  cli.run(main)
