"""Convert a Hugging Face Llama / Qwen3 model directory into a dspec target checkpoint.

  python scripts/convert_hf.py --hf_dir=PATH/Qwen3-0.6B --out=ckpt/qwen3-0.6b \
      [--storage_dtype=bfloat16] [--force]

Reads config.json + safetensors (single or sharded), writes an orbax checkpoint with
`kind='target'` (load it with `dspec.load_target`), and copies the tokenizer files
(tokenizer.json, tokenizer_config.json, generation_config.json, special_tokens_map.json)
the source has. The metadata records whether there was a tokenizer.json and the
eos_token_id the source's config files declare: without a tokenizer it warns, and the
checkpoint decodes token-id prompts only, stopping at those ids. Bad input prints one `error: ...` line and exits with status 1.
"""

import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags, logging  # noqa: E402

from dspec import cli  # noqa: E402

_HF_DIR = flags.DEFINE_string('hf_dir', None, 'Hugging Face model directory.', required=True)
_OUT = flags.DEFINE_string('out', None, 'Checkpoint directory to write.', required=True)
_STORAGE_DTYPE = flags.DEFINE_enum('storage_dtype', 'float32', ['float32', 'bfloat16'],
                                   'Dtype the weights are stored in.')
_FORCE = flags.DEFINE_boolean('force', False, 'Replace an existing --out directory (only a '
                              'dspec checkpoint directory is ever replaced).')

TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'generation_config.json',
                   'special_tokens_map.json')


def convert(hf_dir: str, out: str, storage_dtype: str, force: bool) -> None:
  """Loads `hf_dir`, saves it as a dspec target checkpoint at `out` with its tokenizer."""
  from dspec import files
  from dspec.checkpoint import is_checkpoint_dir, save_model  # heavy imports after parsing
  files.check_outputs({'--out': out}, {'--hf_dir': hf_dir}, force=force,
                      dirs={'--out': is_checkpoint_dir})
  from dspec.hf_import import load_hf_model, read_hf_config
  from dspec.tokenizer import declared_eos_ids
  hf_config = read_hf_config(hf_dir)
  model, cfg = load_hf_model(hf_dir)
  has_tokenizer = os.path.isfile(os.path.join(hf_dir, 'tokenizer.json'))
  eos_ids = declared_eos_ids(hf_dir)
  save_model(out, model, kind='target', config=cfg.to_dict(), storage_dtype=storage_dtype,
             extra={'hf_model_type': hf_config['model_type'],
                    'hf_source': os.path.abspath(hf_dir),
                    'tokenizer': 'tokenizer.json' if has_tokenizer else None,
                    'eos_token_ids': eos_ids},
             force=force)
  for name in TOKENIZER_FILES:
    if os.path.isfile(os.path.join(hf_dir, name)):
      with files.writing(os.path.join(out, name)):
        shutil.copyfile(os.path.join(hf_dir, name), os.path.join(out, name))
  if not has_tokenizer:
    print(f'warning: {hf_dir} has no tokenizer.json: {out} takes prompts as token ids only '
          f'(or give a tokenizer with --config.model.tokenizer_dir); it stops at the ids its '
          f'config declares: {eos_ids or "none"}', file=sys.stderr, flush=True)
  print(f'wrote {out}: {cfg.num_params():,} params ({hf_config["model_type"]}, '
        f'{storage_dtype})')


def main(argv):
  del argv
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  convert(_HF_DIR.value, _OUT.value, _STORAGE_DTYPE.value, _FORCE.value)


if __name__ == '__main__':
  cli.run(main)
