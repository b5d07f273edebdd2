"""A reduced draft vocabulary (FR-Spec style): the drafter's head covers `cfg.draft_vocab`,
a sorted tuple of target token ids (empty: the full vocabulary)."""

from __future__ import annotations

import jax.numpy as jnp


class DraftVocab:
  """Maps between draft-vocabulary indices and target token ids, for modules with `cfg`
  (holding `draft_vocab`) and `target_cfg`."""

  def token_ids(self, index):
    """Target token ids of draft-vocabulary indices (the identity for the full vocabulary)."""
    if not self.cfg.draft_vocab:
      return index.astype(jnp.int32)
    return jnp.asarray(self.cfg.draft_vocab, jnp.int32)[index]

  def draft_index(self, token_ids):
    """Draft-vocabulary index of each token id, -1 where the drafter cannot propose it."""
    if not self.cfg.draft_vocab:
      return token_ids.astype(jnp.int32)
    table_V = jnp.full((self.target_cfg.vocab_size,), -1, jnp.int32)
    table_V = table_V.at[jnp.asarray(self.cfg.draft_vocab)].set(
        jnp.arange(len(self.cfg.draft_vocab), dtype=jnp.int32))
    return table_V[token_ids]
