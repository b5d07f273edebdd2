"""Tests for dspec/tokenizer.py: byte tokenizer, HF tokenizer loading, tiny BPE training."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dspec.tokenizer import (ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer,
                             train_byte_level_bpe)

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = REPO_ROOT / 'data'

SAMPLE_TEXTS = [
    "def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n    return a + b\n",
    'Question: Tom has 3 apples and buys 4 more. How many?\nAnswer: 3 + 4 = <<3+4=7>>7\n#### 7',
    'café, naïve, 世界, emoji 🙂 and tabs\tand\nnewlines',
] * 40


@pytest.fixture(scope='module')
def tiny_bpe_dir(tmp_path_factory):
  out_dir = tmp_path_factory.mktemp('tiny_bpe')
  train_byte_level_bpe(SAMPLE_TEXTS, vocab_size=300, out_dir=str(out_dir))
  return out_dir


@pytest.mark.parametrize('text', ['', 'hello world', 'café 世界 🙂', 'a\x00b\n\t'])
def test_byte_tokenizer_round_trip(text):
  tok = ByteTokenizer()
  ids = tok.encode(text)
  assert all(0 <= i < 256 for i in ids)
  assert len(ids) == len(text.encode('utf-8'))
  assert tok.decode(ids) == text


def test_byte_tokenizer_decode_skips_specials_and_replaces_bad_utf8():
  tok = ByteTokenizer(vocab_size=260, eos_id=256, bos_id=257)
  ids = [257] + tok.encode('hé') + [256, 300, -1]
  assert tok.decode(ids) == 'hé'
  assert tok.decode([0xFF, ord('A')]) == '\ufffdA'
  assert tok.decode(tok.encode('é')[:1]) == '\ufffd'  # truncated multi-byte character


def test_byte_tokenizer_fields_and_validation():
  tok = ByteTokenizer(vocab_size=258, eos_id=257)
  assert isinstance(tok, Tokenizer)
  assert (tok.vocab_size, tok.eos_id, tok.bos_id, tok.stop_ids) == (258, 257, None, (257,))
  assert ByteTokenizer(vocab_size=256, eos_id=None).stop_ids == ()
  with pytest.raises(ValueError, match='vocab_size >= 256'):
    ByteTokenizer(vocab_size=100)
  with pytest.raises(ValueError, match='eos_id=300'):
    ByteTokenizer(vocab_size=260, eos_id=300)


def test_load_tokenizer_byte_fallback(tmp_path):
  tok = load_tokenizer(None, vocab_size=300)
  assert isinstance(tok, ByteTokenizer)
  assert tok.eos_id == 256 and tok.stop_ids == (256,)
  assert load_tokenizer(None, vocab_size=256).eos_id is None
  (tmp_path / 'config.json').write_text(json.dumps({'eos_token_id': [258, 257]}))
  tok = load_tokenizer(str(tmp_path), vocab_size=300)
  assert tok.eos_id == 258 and tok.stop_ids == (258, 257)


def test_load_tokenizer_errors(tmp_path):
  # Below 256 ids there is no byte fallback: token ids only (text is the error).
  with pytest.raises(ValueError, match='give prompts as token ids'):
    load_tokenizer(None, vocab_size=100).encode('abc')
  with pytest.raises(ValueError, match='has no tokenizer.json'):
    load_tokenizer(str(tmp_path), vocab_size=64).encode('abc')
  with pytest.raises(FileNotFoundError, match='does not exist'):
    load_tokenizer(str(tmp_path / 'missing'), vocab_size=300)


def test_tiny_bpe_round_trip_and_special_ids(tiny_bpe_dir):
  tok = load_tokenizer(str(tiny_bpe_dir), vocab_size=300)
  assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
  assert tok.vocab_size == 300
  assert (tok.eos_id, tok.mask_id, tok.bos_id, tok.stop_ids) == (0, 1, None, (0,))
  assert tok.token_to_id('<|endoftext|>') == 0 and tok.token_to_id('<|mask|>') == 1
  for text in set(SAMPLE_TEXTS) | {'unseen: ünïcödé ∑ 🚀 text'}:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
  code = SAMPLE_TEXTS[0]
  assert len(tok.encode(code)) < len(code.encode('utf-8')), 'BPE merges should compress'
  assert tok.decode([0] + tok.encode('ab') + [1, 10_000, -3]) == 'ab'
  config = json.loads((tiny_bpe_dir / 'tokenizer_config.json').read_text())
  assert config['eos_token'] == '<|endoftext|>' and config['eos_token_id'] == 0


def test_bpe_training_is_deterministic(tiny_bpe_dir, tmp_path):
  train_byte_level_bpe(SAMPLE_TEXTS, vocab_size=300, out_dir=str(tmp_path))
  assert (tmp_path / 'tokenizer.json').read_bytes() == (
      tiny_bpe_dir / 'tokenizer.json').read_bytes()


def test_hf_special_ids_from_model_config(tiny_bpe_dir, tmp_path):
  shutil.copy(tiny_bpe_dir / 'tokenizer.json', tmp_path / 'tokenizer.json')
  # No tokenizer_config.json: falls back to the common name <|endoftext|>.
  assert HFTokenizer(str(tmp_path)).eos_id == 0
  (tmp_path / 'config.json').write_text(json.dumps({'eos_token_id': [5, 0], 'bos_token_id': 7}))
  tok = HFTokenizer(str(tmp_path / 'tokenizer.json'))
  assert (tok.eos_id, tok.stop_ids, tok.bos_id) == (5, (5, 0), 7)
  (tmp_path / 'tokenizer_config.json').write_text(
      json.dumps({'eos_token': {'content': '<|mask|>'}}))
  tok = HFTokenizer(str(tmp_path))
  assert (tok.eos_id, tok.stop_ids) == (1, (1, 5, 0))


def test_load_tokenizer_rejects_tokenizer_larger_than_model(tiny_bpe_dir):
  with pytest.raises(ValueError, match='does not belong to this model'):
    load_tokenizer(str(tiny_bpe_dir), vocab_size=299)


@pytest.mark.multiprocess
def test_train_tokenizer_script(tmp_path):
  result = subprocess.run(
      [sys.executable, str(REPO_ROOT / 'scripts' / 'train_tokenizer.py'),
       f'--out_dir={tmp_path}', '--vocab_size=300', '--max_chars=20000',
       f'--data_dir={DATA_DIR}'],
      capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
  assert result.returncode == 0, result.stderr
  tok = load_tokenizer(str(tmp_path), vocab_size=300)
  assert (tok.eos_id, tok.mask_id) == (0, 1)
  text = 'Question: What is 2 + 2?\nAnswer: 4'
  assert tok.decode(tok.encode(text)) == text
