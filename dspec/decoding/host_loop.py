"""A host-side step loop for drafters that propose on the CPU host (e.g. suffix trees).

Each iteration lets the host drafter propose from its copy of the committed tokens, runs
the engine's jitted step with that proposal, and reads back only what the step committed
(at most γ + 1 tokens per row, plus the counters), never the whole token buffer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dspec.decoding.prompts import row_tokens
from dspec.decoding.state import Proposal


@functools.partial(jax.jit, static_argnums=2)
def _committed_since(state, since_B, width: int):
  """(tokens at since_B + 0..width-1 [B, width], num_tokens_B, done_B)."""
  b, length = state.tokens_BL.shape
  idx_BW = jnp.minimum(since_B[:, None] + jnp.arange(width)[None, :], length - 1)
  return state.tokens_BL[jnp.arange(b)[:, None], idx_BW], state.num_tokens_B, state.done_B


def generate_host_loop(engine, target_params, drafter_params, state, host_drafter):
  """Runs `engine.step` until every row is done, proposals coming from `host_drafter`."""
  tokens, num, done = jax.device_get((state.tokens_BL, state.num_tokens_B, state.done_B))
  sequences = row_tokens(tokens, num)
  host_drafter.start(sequences)
  width = engine.num_draft + 1
  while not done.all():
    tokens_BG, num_B = host_drafter.propose(sequences, ~done)
    proposal = jax.device_put(Proposal(np.asarray(tokens_BG, np.int32),
                                       np.asarray(num_B, np.int32)))
    state = engine.step(target_params, drafter_params, state, proposal)
    new_BW, new_num, done = jax.device_get(
        _committed_since(state, jax.device_put(np.asarray(num, np.int32)), width))
    for b, seq in enumerate(sequences):
      seq.extend(new_BW[b, :new_num[b] - num[b]].tolist())
    num = new_num
  host_drafter.finish(sequences)
  return state
