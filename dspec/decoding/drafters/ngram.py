"""Prompt lookup / n-gram drafting, entirely on device.

The last n committed tokens (n = max_n down to min_n, largest first) are searched for in
prompt + output; the most recent earlier occurrence wins and the tokens that followed it are
proposed (`num_draft` of them; where the continuation reaches the end of the committed
text it repeats periodically, as a loop would). No match: no proposal.
Tree verification (`NgramTrees`) takes the `top_k` most recent occurrences of that n
instead, one continuation each, merged into a trie.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from dspec.decoding import tree_proposers
from dspec.decoding.drafter import StatelessDrafter, check_num_draft
from dspec.decoding.state import Proposal
from dspec.sampling import top_k as top_k_barrier


def _match_ends_BL(tokens_BL, num_tokens_B, n: int):
  """[B, L] bool: an earlier occurrence of the last n tokens ends (exclusive) at p."""
  b, length = tokens_BL.shape
  rows = jnp.arange(b)[:, None]
  p_P = jnp.arange(length)[None, :]
  match = jnp.ones((b, length), bool)
  for k in range(n):
    suffix_tok = tokens_BL[jnp.arange(b), jnp.clip(num_tokens_B - n + k, 0, length - 1)]
    window_tok = tokens_BL[rows, jnp.clip(p_P - n + k, 0, length - 1)]
    match &= window_tok == suffix_tok[:, None]
  return match & (p_P >= n) & (p_P < num_tokens_B[:, None]) & (num_tokens_B[:, None] > n)


@dataclasses.dataclass(frozen=True)
class NgramDrafter(StatelessDrafter):
  """Prompt-lookup decoding (Saxena 2023; vLLM `ngram`) with a configurable n range."""

  num_draft: int = 8
  min_n: int = 1
  max_n: int = 4
  proposes_from_tokens = True   # the controller judges it in retrospect

  def __post_init__(self):
    if not 1 <= self.min_n <= self.max_n:
      raise ValueError(f'ngram needs 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}')
    check_num_draft('ngram', self.num_draft)

  def propose(self, params, state, target, ctx, key):
    return self.propose_from_tokens(ctx.tokens_BL, ctx.num_tokens_B)

  def propose_from_tokens(self, tokens_BL, num_tokens_B) -> Proposal:
    """The proposal after the first `num_tokens_B` tokens: it reads nothing past them, so
    what was proposed at an earlier length can be recomputed later (the controller's
    retrospective shadow drafts)."""
    ends_B1 = self.recent_matches(tokens_BL, num_tokens_B, 1)
    draft_BG = self.continuations(tokens_BL, num_tokens_B, ends_B1)[:, 0]
    num_B = jnp.where(ends_B1[:, 0] >= 0, self.num_draft, 0)
    return Proposal(draft_BG, num_B.astype(jnp.int32))

  def recent_matches(self, tokens_BL, num_tokens_B, k: int):
    """[B, k] int32 end indices of the k most recent occurrences of the last n tokens, n
    the largest of max_n..min_n with any; most recent first, -1 past the last (no match:
    all -1)."""
    b, length = tokens_BL.shape
    ends_BL = jnp.zeros((b, length), bool)
    for n in range(self.max_n, self.min_n - 1, -1):
      ends_BL = jnp.where(jnp.any(ends_BL, axis=1, keepdims=True), ends_BL,
                          _match_ends_BL(tokens_BL, num_tokens_B, n))
    p_BL = jnp.where(ends_BL, jnp.arange(length, dtype=jnp.int32)[None, :], -1)
    if k == 1:
      return jnp.max(p_BL, axis=1, keepdims=True)
    return top_k_barrier(p_BL, min(k, length))[0]

  def continuations(self, tokens_BL, num_tokens_B, ends_BK):
    """[B, K, num_draft] int32: the tokens after each match end. Where a continuation
    tokens[p:] runs into the proposal itself (p + j >= num_tokens) it repeats with period
    num_tokens - p, which is what a loop would produce (garbage for ends of -1)."""
    b, length = tokens_BL.shape
    j_G = jnp.arange(self.num_draft)[None, None, :]
    period_BK = jnp.maximum(num_tokens_B[:, None] - ends_BK, 1)
    idx_BKG = jnp.clip(ends_BK[:, :, None] + j_G % period_BK[:, :, None], 0, length - 1)
    return tokens_BL[jnp.arange(b)[:, None, None], idx_BKG].astype(jnp.int32)

  def tree_proposer(self, top_k: int):
    """Tree verification's trees: the continuations of the `top_k` most recent matches
    (`recent_matches`) merged into a trie (`tree_proposers.NgramTrees`); top_k = 1 is the
    chain proposal."""
    return tree_proposers.NgramTrees(top_k)


def build(cfg, target):
  c = cfg.drafters.ngram
  return NgramDrafter(num_draft=c.num_draft, min_n=c.min_n, max_n=c.max_n), None
