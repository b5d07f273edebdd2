"""The controller's tiers: a drafter per verify length, and whether its state fits."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspec.decoding.drafter import TruncatedDrafter


def tier_drafter(drafter, gamma: int):
  """`drafter` proposing `gamma` tokens: its proposal truncated (tier 0, and drafters that
  draft a whole block in one pass), else `with_num_draft`; None when it cannot."""
  if gamma == 0 or (drafter.truncate_for_tiers and gamma <= drafter.num_draft):
    return TruncatedDrafter(drafter, gamma)
  try:
    return drafter.with_num_draft(gamma)
  except ValueError:
    return None


def same_drafter_state(engine, target_params, drafter_params, prompt_shape, state) -> bool:
  """Whether `engine`'s drafter keeps a state of the same structure and shapes."""
  prompt_BP = jax.ShapeDtypeStruct(prompt_shape, jnp.int32)
  lens_B = jax.ShapeDtypeStruct(state.num_tokens_B.shape, jnp.int32)
  try:
    out = jax.eval_shape(
        lambda p, l: engine.prefill_fn(target_params, drafter_params, p, l, 0.0, 1.0, 1, 0,
                                       buffer_len=state.tokens_BL.shape[1]),
        prompt_BP, lens_B)
  except (ValueError, TypeError):
    return False
  shapes = lambda t: [(x.shape, x.dtype) for x in jax.tree.leaves(t)]
  return (jax.tree.structure(out.drafter_state) == jax.tree.structure(state.drafter_state)
          and shapes(out.drafter_state) == shapes(state.drafter_state))
