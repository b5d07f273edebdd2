"""Oracle drafting: the target's own greedy continuation, with a synthetic acceptance profile.

For engine-overhead measurements (vLLM's "synthetic acceptance" idea, made lossless) and
the empirical τ ceiling at T = 0: `init` rolls the target out greedily from the prompt to
the end of the token buffer on a private cache (the reference, kept as the drafter's
state); each step proposes the reference tokens after the committed ones and corrupts
position j with probability 1 - profile[j] (conditional acceptance; the last value
repeats). Output stays exactly the target's: corrupted drafts are simply rejected. At
T = 0 with profile (1.0,) every draft is the AR token, up to float ties between the
one-token rollout and the γ+1-token verify forward.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Tuple

import jax
import jax.numpy as jnp
from flax import struct

from dspec.decoding.drafter import DrafterBase, check_num_draft
from dspec.decoding.state import Proposal


@struct.dataclass
class OracleState:
  ref_BL: jnp.ndarray   # prompt + the target's greedy continuation, per row

  LOGICAL_AXES: ClassVar[dict] = {'ref_BL': ('batch', None)}


@dataclasses.dataclass(frozen=True)
class OracleDrafter(DrafterBase):
  """State: `OracleState`, the reference sequences (prompt + greedy continuation)."""

  num_draft: int = 8
  acceptance: Tuple[float, ...] = (1.0,)

  def __post_init__(self):
    check_num_draft('oracle', self.num_draft)
    if not self.acceptance or any(not 0.0 <= a <= 1.0 for a in self.acceptance):
      raise ValueError(f'oracle acceptance values must be in [0, 1], got {self.acceptance}')

  def profile(self):
    a = list(self.acceptance) + [self.acceptance[-1]] * self.num_draft
    return jnp.asarray(a[:self.num_draft], jnp.float32)

  def init(self, params, target, ctx, prefill_out):
    """Greedy rollout from the last committed token to the end of the buffer."""
    b, length = ctx.tokens_BL.shape
    rows = jnp.arange(b)

    def body(carry):
      i, ref_BL, cache = carry
      pos_B = ctx.num_tokens_B - 1 + i
      token_B = ref_BL[rows, jnp.minimum(pos_B, length - 1)]
      out = target(token_B[:, None], cache=cache)
      next_B = jnp.argmax(out.logits_BTV[:, 0], axis=-1).astype(jnp.int32)
      ref_BL = ref_BL.at[rows, pos_B + 1].set(next_B, mode='drop')
      return i + 1, ref_BL, out.cache.with_lengths(jnp.minimum(cache.lengths_B + 1,
                                                               length - 1))

    steps = length - 1 - jnp.min(ctx.num_tokens_B - 1)
    cache = prefill_out.cache.with_lengths(ctx.num_tokens_B - 1)
    _, ref_BL, _ = jax.lax.while_loop(lambda c: c[0] < steps, body,
                                      (jnp.zeros((), jnp.int32), ctx.tokens_BL, cache))
    return OracleState(ref_BL)

  def update(self, params, state, target, ctx, verify_out, start_B, num_accepted_B):
    return state

  def propose(self, params, state, target, ctx, key):
    ref_BL = state.ref_BL
    b, length = ref_BL.shape
    j = jnp.arange(self.num_draft)[None, :]
    idx = jnp.clip(ctx.num_tokens_B[:, None] + j, 0, length - 1)
    draft_BG = ref_BL[jnp.arange(b)[:, None], idx]
    corrupt = jax.random.uniform(key, draft_BG.shape) >= self.profile()[None, :]
    draft_BG = jnp.where(corrupt, (draft_BG + 1) % target.cfg.vocab_size, draft_BG)
    return Proposal(draft_BG.astype(jnp.int32), jnp.full((b,), self.num_draft, jnp.int32))


def build(cfg, target):
  c = cfg.drafters.oracle
  return OracleDrafter(num_draft=c.num_draft, acceptance=tuple(c.acceptance)), None
