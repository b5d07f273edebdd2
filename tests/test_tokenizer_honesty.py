"""Tokenizer honesty: a Hugging Face model without tokenizer.json (loaded directly or through
`convert_hf.py`, which warns and records it) takes token ids only: text prompts are one
clear error, id prompts decode, and generation stops at the ids its own config declares,
never at a byte-fallback id 256 that is an ordinary token of its vocabulary. A vocabulary
below 256 loads and decodes from ids."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

import dspec
from conftest import REPO_ROOT, TINY
from dspec import checkpoint
from dspec.hf_export import export_to_hf
from dspec.models.transformer import Transformer
from dspec.tokenizer import ByteTokenizer, IdsOnlyTokenizer, load_tokenizer

PROMPT = [3, 4, 5, 6, 3, 4, 5, 6]
WIDE = dataclasses.replace(TINY, vocab_size=300)     # 256 is one of its real tokens


def _hf_dir(path, cfg, eos=None, generation_eos=None):
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  model.lm_head[...] = model.lm_head[...] * 20.0
  export_to_hf(model, path)
  config = json.load(open(os.path.join(path, 'config.json')))
  json.dump(dict(config, eos_token_id=eos), open(os.path.join(path, 'config.json'), 'w'))
  if generation_eos is not None:
    json.dump({'eos_token_id': generation_eos},
              open(os.path.join(path, 'generation_config.json'), 'w'))
  return str(path)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_convert_hf_without_tokenizer_warns_records_and_takes_ids_only(tmp_path):
  hf = _hf_dir(tmp_path / 'hf', WIDE, eos=7, generation_eos=[7, 9])
  out = str(tmp_path / 'ckpt')
  proc = subprocess.run([sys.executable, os.path.join(REPO_ROOT, 'scripts', 'convert_hf.py'),
                         f'--hf_dir={hf}', f'--out={out}'], capture_output=True, text=True,
                        cwd=REPO_ROOT, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  warning = [line for line in proc.stderr.splitlines() if line.startswith('warning: ')]
  assert len(warning) == 1 and 'no tokenizer.json' in warning[0] and '[7, 9]' in warning[0]
  extra = checkpoint.read_model_metadata(out, 'target')['extra']
  assert extra['tokenizer'] is None and extra['eos_token_ids'] == [7, 9]
  for path in (out, hf):      # the checkpoint, and the HF directory loaded directly
    target = dspec.load_target(path)
    assert isinstance(target.tokenizer, IdsOnlyTokenizer)
    assert target.tokenizer.stop_ids == (7, 9) and 256 not in target.tokenizer.stop_ids
    with pytest.raises(ValueError, match='has no tokenizer.json: give prompts as token ids'):
      dspec.generate(target, ['hello'], max_new_tokens=4)
    out_ids = dspec.generate(target, [PROMPT], max_new_tokens=6)
    assert out_ids.texts == [str(out_ids.ids[0])]


@pytest.mark.slow
def test_generation_stops_at_the_models_declared_eos(tmp_path):
  """A model declaring no eos never stops; with a generation_config eos (here a token the
  target emits) generation stops there."""
  hf = _hf_dir(tmp_path / 'hf', WIDE)
  target = dspec.load_target(hf)
  assert target.tokenizer.stop_ids == ()
  free = dspec.generate(target, [PROMPT], max_new_tokens=8).ids[0]
  assert len(free) == 8
  stop = free[2]
  json.dump({'eos_token_id': stop}, open(os.path.join(hf, 'generation_config.json'), 'w'))
  stopped = dspec.generate(dspec.load_target(hf), [PROMPT], max_new_tokens=8).ids[0]
  assert stopped == free[:free.index(stop) + 1]


@pytest.mark.slow
def test_a_vocabulary_below_256_without_tokenizer_decodes_from_ids(tmp_path):
  small = dataclasses.replace(TINY, vocab_size=64)
  hf = _hf_dir(tmp_path / 'hf', small, eos=5)
  target = dspec.load_target(hf)
  assert target.tokenizer.stop_ids == (5,)
  out = dspec.generate(target, [PROMPT], max_new_tokens=6)
  assert len(out.ids[0]) <= 6 and all(0 <= t < 64 for t in out.ids[0])
  with pytest.raises(ValueError, match='no tokenizer.json'):
    dspec.generate(target, ['abc'], max_new_tokens=4)
  tok = load_tokenizer(None, 64)          # random weights, no directory: ids only too
  assert isinstance(tok, IdsOnlyTokenizer) and tok.stop_ids == ()
  assert isinstance(load_tokenizer(None, 300), ByteTokenizer)   # dspec's byte models


def test_declared_ids_outside_the_vocabulary_are_an_error(tmp_path):
  hf = _hf_dir(tmp_path / 'hf', dataclasses.replace(TINY, vocab_size=64), eos=200)
  with pytest.raises(ValueError, match='special token id 200 is outside the vocabulary'):
    dspec.load_target(hf)
  with pytest.raises(ValueError, match='tokenizer_dir=.*no tokenizer.json'):
    dspec.load_target(hf, tokenizer_dir=str(tmp_path))
