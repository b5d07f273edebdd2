"""Train the demo target's byte-level BPE tokenizer on Python stdlib + GSM8K train text.

  python scripts/train_tokenizer.py --out_dir=demo/tokenizer --vocab_size=8192

Writes OUT_DIR/tokenizer.json and OUT_DIR/tokenizer_config.json (`<|endoftext|>` = id 0 is
EOS, `<|mask|>` = id 1 is the spare DFlash MASK id). Only the training split of each corpus is
used; documents are taken in a fixed hash order up to --max_chars, so the result is
deterministic. An OUT_DIR holding other files is refused unless --force (then only the two
files are written), and so is one inside --data_dir.
"""

import hashlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from dspec import cli, files  # noqa: E402
from dspec.tokenizer import TOKENIZER_FILES, train_byte_level_bpe  # noqa: E402
from dspec.datasets import (DEFAULT_HELDOUT_FRACTION, load_corpus,  # noqa: E402
                                   split_documents)

_OUT_DIR = flags.DEFINE_string('out_dir', None, 'Directory to write the tokenizer files to.',
                               required=True)
_VOCAB_SIZE = flags.DEFINE_integer('vocab_size', 8192, 'Vocabulary size, special tokens included.')
_DATA_DIR = flags.DEFINE_string('data_dir', 'data',
                                'Folder holding gsm8k/ (relative paths: cwd, then project root).')
_MAX_CHARS = flags.DEFINE_integer('max_chars', 30_000_000,
                                  'Stop adding documents once this many characters are taken.')
_FORCE = flags.DEFINE_bool('force', False, 'Write the tokenizer files into an --out_dir '
                           'that holds other files (nothing else in it is touched).')
_CORPORA = ('python_stdlib', 'gsm8k')


def _tokenizer_dir(out_dir: str) -> bool:
  """An earlier --out_dir: it holds the tokenizer files and nothing else."""
  return set(os.listdir(out_dir)) - {files.LOCK_FILE} <= set(TOKENIZER_FILES)


def main(argv):
  del argv
  if _MAX_CHARS.value < 1:
    raise cli.UserError(f'--max_chars must be >= 1, got {_MAX_CHARS.value}')
  files.check_outputs({'--out_dir': _OUT_DIR.value}, {'--data_dir': _DATA_DIR.value},
                      force=_FORCE.value, dirs={'--out_dir': _tokenizer_dir})
  docs = [doc for name in _CORPORA
          for doc in split_documents(load_corpus(name, _DATA_DIR.value),
                                     DEFAULT_HELDOUT_FRACTION, 'train')]
  docs.sort(key=lambda doc: hashlib.sha256(doc.id.encode('utf-8')).digest())
  texts, total_chars = [], 0
  for doc in docs:
    if total_chars >= _MAX_CHARS.value:
      break
    texts.append(doc.text)
    total_chars += len(doc.text)
  tokenizer = train_byte_level_bpe(texts, _VOCAB_SIZE.value, _OUT_DIR.value)
  print(f'trained on {len(texts)} documents, {total_chars:,} chars -> {tokenizer}')


if __name__ == '__main__':
  cli.run(main)
