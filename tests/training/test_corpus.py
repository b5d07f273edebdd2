"""Tests for dspec/training/corpus.py: tokenizing and packing documents into windows."""

import numpy as np
import pytest

from dspec.datasets import Document
from dspec.tokenizer import ByteTokenizer
from dspec.training.corpus import pack_tokens, pack_tokens_by_domain

EOS = 256


def _docs(*specs):
  return [Document(text=text, domain=domain, id=f'doc{i}')
          for i, (text, domain) in enumerate(specs)]


def test_pack_tokens_shapes_and_eos_separation():
  tok = ByteTokenizer()
  docs = _docs(('hello', 'a'), ('wörld!', 'b'), ('x' * 20, 'a'))
  stream = [t for doc in docs for t in tok.encode(doc.text) + [EOS]]
  windows = pack_tokens(docs, tok, seq_len=8, eos_id=EOS)
  assert windows.dtype == np.int32
  assert windows.shape == ((len(stream) - 1) // 8, 9)
  # Consecutive windows share one token; together they cover the stream's prefix.
  np.testing.assert_array_equal(windows[1:, 0], windows[:-1, -1])
  flat = np.concatenate([windows[:, :-1].ravel(), windows[-1:, -1]])
  np.testing.assert_array_equal(flat, stream[:len(flat)])
  eos_positions = np.flatnonzero(np.asarray(stream) == EOS)
  np.testing.assert_array_equal(eos_positions, [5, 5 + 8, 5 + 8 + 21])
  assert pack_tokens([], tok, seq_len=8, eos_id=EOS).shape == (0, 9)
  assert pack_tokens(_docs(('ab', 'a')), tok, seq_len=8, eos_id=EOS).shape == (0, 9)
  with pytest.raises(ValueError, match='eos_id'):
    pack_tokens(docs, tok, seq_len=8, eos_id=None)


def test_pack_tokens_by_domain():
  tok = ByteTokenizer()
  docs = _docs(('aaaa', 'a'), ('bbbbbbbb', 'b'), ('aaaaaa', 'a'))
  packed = pack_tokens_by_domain(docs, tok, seq_len=4, eos_id=EOS)
  assert sorted(packed) == ['a', 'b']
  assert set(np.unique(packed['a'])) == {ord('a'), EOS}
  assert set(np.unique(packed['b'])) == {ord('b'), EOS}
  assert packed['a'].shape == ((4 + 1 + 6 + 1 - 1) // 4, 5)
