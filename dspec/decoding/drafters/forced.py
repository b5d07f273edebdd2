"""Drafting only what a constraint forces (vLLM's `grammar` method).

The device proposes nothing; under structured output (`dspec.structured`) the host fills
each step's proposal with the tokens the grammar forces from there on (JSON keys, brackets,
separators), one-hot drafts the verify accepts wherever the target's masked distribution
agrees. Any learned drafter gets the same forced drafts merged into its own proposals
(`forced_drafts`); this one is them alone, for a constraint without a learned drafter.
"""

from __future__ import annotations

import dataclasses

from dspec.decoding.drafter import StatelessDrafter, check_num_draft, empty_proposal


@dataclasses.dataclass(frozen=True)
class ForcedTokenDrafter(StatelessDrafter):
  """Proposes nothing on device; `num_draft` forced tokens at most per step."""

  num_draft: int = 16
  needs_constraint = True   # without one it would be plain AR with a wider verify

  def __post_init__(self):
    check_num_draft('grammar', self.num_draft)

  def propose(self, params, state, target, ctx, key):
    return empty_proposal(ctx.tokens_BL.shape[0], self.num_draft)


def build(cfg, target):
  return ForcedTokenDrafter(num_draft=cfg.drafters.grammar.num_draft), None
