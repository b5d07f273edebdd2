"""The target as its own drafter: γ autoregressive target steps on a private cache.

A correctness instrument, not a speedup: at T=0 every draft is accepted, and at T>0 its
q equals p exactly, so rejection sampling accepts everything too. Its cache after a step is
the target's verify cache rewound to the committed length (same model, same K/V).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dspec.decoding.drafter import DrafterBase, check_num_draft
from dspec.sampling import processed_probs, sample_from_probs
from dspec.decoding.state import Proposal


@dataclasses.dataclass(frozen=True)
class SelfDrafter(DrafterBase):
  """State: the drafter's own copy of the target cache (positions < num_tokens - 1)."""

  num_draft: int = 4
  samples_proposals = True

  def __post_init__(self):
    check_num_draft('self', self.num_draft)

  def init(self, params, target, ctx, prefill_out):
    return prefill_out.cache.with_lengths(ctx.num_tokens_B - 1)

  def propose(self, params, cache, target, ctx, key):
    b = ctx.tokens_BL.shape[0]
    token_B = ctx.tokens_BL[jnp.arange(b), ctx.num_tokens_B - 1]
    drafts, qs = [], []
    for j in range(self.num_draft):
      out = target(token_B[:, None], cache=cache)
      cache = out.cache.with_lengths(cache.lengths_B + 1)
      logits_BV = out.logits_BTV[:, 0]
      if ctx.sampling.greedy:
        token_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
      else:
        q_BV = processed_probs(logits_BV, ctx.sampling, ctx.temperature, ctx.top_p)
        token_B = sample_from_probs(jax.random.fold_in(key, j), q_BV)
        qs.append(q_BV)
      drafts.append(token_B)
    q_BGV = jnp.stack(qs, axis=1) if qs else None
    return Proposal(jnp.stack(drafts, axis=1), jnp.full((b,), self.num_draft, jnp.int32),
                    q_BGV)

  def update(self, params, cache, target, ctx, verify_out, start_B, num_accepted_B):
    return verify_out.cache.with_lengths(start_B + num_accepted_B + 1)


def build(cfg, target):
  return SelfDrafter(num_draft=cfg.drafters.self.num_draft), None
