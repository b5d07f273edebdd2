"""A reduced draft vocabulary (FR-Spec style): the drafter's head covers `cfg.draft_vocab`,
a sorted tuple of target token ids (empty: the full vocabulary).

Training picks it from the distilled data (`frequent_tokens`); a drafter trained on the
full vocabulary can also be restricted when it is loaded, from a token map (`token_map`:
a JSON list of token ids, SGLang's `speculative_token_map`; `scripts/token_map.py` writes
one), as FastMTP compresses its draft vocabulary at inference.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np


def frequent_tokens(tokens, loss_mask, count: int, vocab_size: int,
                    name: str = 'draft_vocab_size') -> tuple:
  """The `count` token ids the target writes most often (ties: more frequent overall,
  then lower id), sorted: the draft vocabulary of a reduced head. `name` is the knob that
  asked for `count` (for the error message)."""
  if not 0 < count <= vocab_size:
    raise ValueError(f'{name} must be in [1, {vocab_size}], got {count}')
  written = np.bincount(tokens[loss_mask.astype(bool)].ravel(), minlength=vocab_size)
  seen = np.bincount(tokens.ravel(), minlength=vocab_size)
  ids = np.arange(vocab_size)
  order = np.lexsort((ids, -seen[:vocab_size], -written[:vocab_size]))
  return tuple(sorted(int(i) for i in order[:count]))


def read_token_map(path: str, vocab_size: int) -> tuple:
  """The sorted token ids of a token-map file (a JSON list of distinct ids in
  [0, vocab_size)); ValueError naming the file otherwise."""
  try:
    with open(path) as f:
      ids = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f'{path}: token map is not JSON ({e})') from None
  if not isinstance(ids, list) or not ids or \
      not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
    raise ValueError(f'{path}: a token map is a non-empty JSON list of token ids')
  if len(set(ids)) != len(ids):
    raise ValueError(f'{path}: token map repeats token ids')
  if not 0 <= min(ids) <= max(ids) < vocab_size:
    raise ValueError(f'{path}: token map ids must lie in [0, {vocab_size}) (the target\'s '
                     f'vocabulary), got {min(ids)}..{max(ids)}')
  return tuple(sorted(ids))


class DraftVocab:
  """Maps between draft-vocabulary indices and target token ids, for modules with `cfg`
  (holding `draft_vocab`) and `target_cfg`."""

  def token_ids(self, index):
    """Target token ids of draft-vocabulary indices (the identity for the full vocabulary)."""
    if not self.cfg.draft_vocab:
      return index.astype(jnp.int32)
    return jnp.asarray(self.cfg.draft_vocab, jnp.int32)[index]

  def over_target_vocab(self, q_BV):
    """A draft-vocabulary distribution [B, V'] placed into the target vocabulary [B, V]."""
    if not self.cfg.draft_vocab:
      return q_BV
    full_BV = jnp.zeros((q_BV.shape[0], self.target_cfg.vocab_size), q_BV.dtype)
    return full_BV.at[:, jnp.asarray(self.cfg.draft_vocab)].set(q_BV)

  def draft_index(self, token_ids):
    """Draft-vocabulary index of each token id, -1 where the drafter cannot propose it."""
    if not self.cfg.draft_vocab:
      return token_ids.astype(jnp.int32)
    table_V = jnp.full((self.target_cfg.vocab_size,), -1, jnp.int32)
    table_V = table_V.at[jnp.asarray(self.cfg.draft_vocab)].set(
        jnp.arange(len(self.cfg.draft_vocab), dtype=jnp.int32))
    return table_V[token_ids]
