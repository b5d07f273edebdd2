"""The drafter protocol every proposal method implements.

A drafter is a frozen (hashable) dataclass holding only static knobs; its weights and its
per-sequence state are pytrees passed in and out, so one jitted speculative step serves
every drafter:

  state = drafter.init(params, target, ctx, prefill_out)
  proposal = drafter.propose(params, state, target, ctx, key)
  state = drafter.update(params, state, target, ctx, verify_out, start_B, num_accepted_B)

`ctx` is the committed sequence (`DraftContext`); `prefill_out` / `verify_out` are the target
`TargetOutput`s (logits, post-norm hidden, requested taps). `update` sees the context after
commit: verify position j (0..γ) sits at absolute position start_B + j and the first
num_accepted_B + 1 of them are now committed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Tuple

import jax.numpy as jnp

from dspec.decoding.state import DraftContext, Proposal


class Drafter(Protocol):
  num_draft: int                 # γ: draft tokens proposed per step (static)
  taps: Tuple[int, ...]          # target layers whose residual outputs the drafter needs

  def init(self, params, target, ctx: DraftContext, prefill_out) -> Any: ...

  def propose(self, params, state, target, ctx: DraftContext, key) -> Proposal: ...

  def update(self, params, state, target, ctx: DraftContext, verify_out, start_B,
             num_accepted_B) -> Any: ...

  def check_target(self, target_cfg) -> None:
    """Raises ValueError with one clear line when the drafter does not fit the target."""


def check_width_and_vocab(kind: str, drafter_target_cfg, target_cfg) -> None:
  """ValueError (one line) when a drafter built for one target meets another's shapes."""
  if target_cfg.embed_dim != drafter_target_cfg.embed_dim:
    raise ValueError(f'{kind} drafter width {drafter_target_cfg.embed_dim} does not match '
                     f'the target width {target_cfg.embed_dim}')
  if target_cfg.vocab_size != drafter_target_cfg.vocab_size:
    raise ValueError(f'{kind} drafter vocab {drafter_target_cfg.vocab_size} does not match '
                     f'the target vocab {target_cfg.vocab_size}')


@dataclasses.dataclass(frozen=True)
class NoDrafter:
  """Plain autoregressive decoding: the speculative loop with γ = 0."""

  num_draft: int = 0
  taps: Tuple[int, ...] = ()

  def init(self, params, target, ctx, prefill_out):
    return ()

  def propose(self, params, state, target, ctx, key):
    b = ctx.tokens_BL.shape[0]
    return Proposal(jnp.zeros((b, 0), jnp.int32), jnp.zeros((b,), jnp.int32))

  def update(self, params, state, target, ctx, verify_out, start_B, num_accepted_B):
    return state

  def check_target(self, target_cfg):
    return None
