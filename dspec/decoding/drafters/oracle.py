"""Oracle drafting from a known continuation, with a synthetic acceptance profile.

For engine-overhead measurements (vLLM's "synthetic acceptance" idea, made lossless): the
drafter proposes the reference continuation (e.g. the AR output) and corrupts position j
with probability 1 - profile[j] (conditional acceptance; the last value repeats). Output
stays exactly the target's: corrupted drafts are simply rejected by verification.
"""

from __future__ import annotations

import dataclasses
from typing import Tuple

import jax
import jax.numpy as jnp

from dspec.decoding.state import Proposal


@dataclasses.dataclass(frozen=True)
class OracleDrafter:
  """params: the reference sequences `[B, L]` (prompt + continuation), same layout as tokens."""

  num_draft: int = 8
  acceptance: Tuple[float, ...] = (1.0,)
  vocab_size: int = 2
  taps: Tuple[int, ...] = ()

  def __post_init__(self):
    if not self.acceptance or any(not 0.0 <= a <= 1.0 for a in self.acceptance):
      raise ValueError(f'oracle acceptance values must be in [0, 1], got {self.acceptance}')

  def profile(self):
    a = list(self.acceptance) + [self.acceptance[-1]] * self.num_draft
    return jnp.asarray(a[:self.num_draft], jnp.float32)

  def init(self, params, target, ctx, prefill_out):
    return ()

  def propose(self, params, state, target, ctx, key):
    ref_BL = params
    b, length = ref_BL.shape
    j = jnp.arange(self.num_draft)[None, :]
    idx = jnp.clip(ctx.num_tokens_B[:, None] + j, 0, length - 1)
    draft_BG = ref_BL[jnp.arange(b)[:, None], idx]
    corrupt = jax.random.uniform(key, draft_BG.shape) >= self.profile()[None, :]
    draft_BG = jnp.where(corrupt, (draft_BG + 1) % self.vocab_size, draft_BG)
    num_B = jnp.full((b,), self.num_draft, jnp.int32)
    return Proposal(draft_BG.astype(jnp.int32), num_B)

  def update(self, params, state, target, ctx, verify_out, start_B, num_accepted_B):
    return state

  def check_target(self, target_cfg):
    if self.vocab_size != target_cfg.vocab_size:
      raise ValueError(f'oracle vocab {self.vocab_size} != target vocab '
                       f'{target_cfg.vocab_size}')
