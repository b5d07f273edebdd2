"""Prompt lookup / n-gram drafting, entirely on device.

The last n committed tokens (n = max_n down to min_n, largest first) are searched for in
prompt + output; the most recent earlier occurrence wins and the tokens that followed it are
proposed (`num_draft` of them; where the continuation reaches the end of the committed
text it repeats periodically, as a loop would). No match: no proposal.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from dspec.decoding.drafter import StatelessDrafter, check_num_draft
from dspec.decoding.state import Proposal


def _latest_match(tokens_BL, num_tokens_B, n: int):
  """End index p (exclusive) of the latest occurrence of the last n tokens, or -1."""
  b, length = tokens_BL.shape
  rows = jnp.arange(b)[:, None]
  p_P = jnp.arange(length)[None, :]
  match = jnp.ones((b, length), bool)
  for k in range(n):
    suffix_tok = tokens_BL[jnp.arange(b), jnp.clip(num_tokens_B - n + k, 0, length - 1)]
    window_tok = tokens_BL[rows, jnp.clip(p_P - n + k, 0, length - 1)]
    match &= window_tok == suffix_tok[:, None]
  valid = match & (p_P >= n) & (p_P < num_tokens_B[:, None]) & (num_tokens_B[:, None] > n)
  return jnp.max(jnp.where(valid, p_P, -1), axis=1)


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
    b, length = tokens_BL.shape
    best_B = jnp.full((b,), -1, jnp.int32)
    for n in range(self.max_n, self.min_n - 1, -1):
      found_B = _latest_match(tokens_BL, num_tokens_B, n)
      best_B = jnp.where(best_B >= 0, best_B, found_B)
    # The continuation tokens[p:] may run into the proposal itself (p + j >= num_tokens);
    # there it repeats with period num_tokens - p, which is what a loop would produce.
    j = jnp.arange(self.num_draft)[None, :]
    period_B = jnp.maximum(num_tokens_B - best_B, 1)
    idx_BG = jnp.clip(best_B[:, None] + j % period_B[:, None], 0, length - 1)
    draft_BG = tokens_BL[jnp.arange(b)[:, None], idx_BG]
    num_B = jnp.where(best_B >= 0, self.num_draft, 0)
    return Proposal(draft_BG.astype(jnp.int32), num_B.astype(jnp.int32))


def build(cfg, target):
  c = cfg.drafters.ngram
  return NgramDrafter(num_draft=c.num_draft, min_n=c.min_n, max_n=c.max_n), None
