"""Training windows from text corpora: tokenize, separate documents by EOS, pack.

The corpora themselves (and their train / held-out split) are `dspec.datasets`.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from dspec.datasets import Document
from dspec.tokenizer import Tokenizer


def _token_stream(docs: Iterable[Document], tokenizer: Tokenizer, eos_id: int) -> np.ndarray:
  """All documents tokenized and concatenated, each followed by `eos_id`."""
  pieces = []
  for doc in docs:
    pieces.append(np.asarray(tokenizer.encode(doc.text), dtype=np.int32))
    pieces.append(np.asarray([eos_id], dtype=np.int32))
  return np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)


def _windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
  """Windows of seq_len + 1 tokens at stride seq_len (consecutive windows share one token,
  so every next-token pair of the stream is trained on once); the tail is dropped."""
  num_windows = max(len(stream) - 1, 0) // seq_len
  if num_windows == 0:
    return np.zeros((0, seq_len + 1), np.int32)
  starts = np.arange(num_windows)[:, None] * seq_len
  return stream[starts + np.arange(seq_len + 1)[None, :]]


def pack_tokens(docs: Iterable[Document], tokenizer: Tokenizer, seq_len: int,
                eos_id: int) -> np.ndarray:
  """Int32 [N, seq_len + 1] next-token windows of the EOS-separated documents
  (inputs = [:, :-1], targets = [:, 1:])."""
  if seq_len < 1:
    raise ValueError(f'seq_len must be >= 1, got {seq_len}')
  if eos_id is None:
    raise ValueError('pack_tokens needs an eos_id to separate documents')
  return _windows(_token_stream(docs, tokenizer, eos_id), seq_len)


def pack_tokens_by_domain(docs: Iterable[Document], tokenizer: Tokenizer, seq_len: int,
                          eos_id: int) -> dict[str, np.ndarray]:
  """`pack_tokens` separately for each domain (for per-domain held-out evaluation)."""
  by_domain: dict[str, list[Document]] = {}
  for doc in docs:
    by_domain.setdefault(doc.domain, []).append(doc)
  return {domain: pack_tokens(domain_docs, tokenizer, seq_len, eos_id)
          for domain, domain_docs in by_domain.items()}
