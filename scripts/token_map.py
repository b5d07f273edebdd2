"""Write a token map: the N token ids the target writes most often in distilled data.

  python scripts/token_map.py --data=demo/distill_demo8k --size=2048 \
      --out=demo/token_map_2048.json [--force]

The map is a JSON list of token ids (SGLang's `speculative_token_map`, FR-Spec). Decoding
with `--config.drafters.mtp.token_map=<it>` restricts a full-vocabulary MTP's drafts to
those tokens (FastMTP's vocabulary compression): each depth scores N rows of the head
instead of the whole vocabulary, and verification stays exact. The ids are ranked as the
training tasks rank a reduced draft vocabulary (`draft_vocab.frequent_tokens`). An existing
--out is kept unless --force; bad input prints one `error: ...` line and exits with 1.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

from dspec import cli, console  # noqa: E402

_DATA = flags.DEFINE_string('data', None, 'Distilled dataset (scripts/distill.py).',
                            required=True)
_SIZE = flags.DEFINE_integer('size', None, 'Number of token ids to keep.', required=True)
_OUT = flags.DEFINE_string('out', None, 'JSON file to write.', required=True)
_TARGET = flags.DEFINE_string('target', 'demo/target', 'The target (a dspec checkpoint or a '
                              'Hugging Face directory) whose vocabulary bounds the ids.')
_FORCE = flags.DEFINE_boolean('force', False, 'Replace an existing --out.')


def _vocab_size(target: str) -> int:
  from dspec import checkpoint, hf_import, loading
  if loading.target_source(target) == 'checkpoint':
    return checkpoint.read_model_metadata(target, 'target')['config']['vocab_size']
  return int(hf_import.read_hf_config(target)['vocab_size'])


def main(argv):
  del argv
  console.configure()
  from dspec import files
  from dspec.models.draft_vocab import frequent_tokens
  from dspec.training.distill import load_distilled

  out = _OUT.value
  files.check_outputs({'--out': out}, {'--data': _DATA.value, '--target': _TARGET.value},
                      force=_FORCE.value)
  data = load_distilled(_DATA.value)
  ids = frequent_tokens(data['tokens'], data['loss_mask'], _SIZE.value,
                        _vocab_size(_TARGET.value), '--size')
  written = data['tokens'][data['loss_mask'].astype(bool)]
  covered = float(np.isin(written, ids).mean()) if written.size else 0.0
  files.write_json_atomic(out, list(ids), indent=None)
  print(f'wrote {len(ids)} token ids to {out}: they cover {covered:.2%} of the '
        f'{written.size} target-written tokens in {_DATA.value}')


if __name__ == '__main__':
  cli.run(main)
