"""A host-side step loop for drafters that propose on the CPU host (e.g. suffix trees).

Each iteration lets the host drafter propose from its copy of the committed tokens, runs
the engine's jitted step with that proposal, and reads back only what the step committed
(at most γ + 1 tokens per row, plus the counters), never the whole token buffer.

With `fallback` (an engine over the same state that verifies nothing, i.e. plain AR), a
drafter that stops paying stops costing a host round trip per token: after `patience`
steps in a row that accepted no draft (empty proposals or rejected ones) the loop runs AR
chunks on device (`chunk` steps, doubling up to `max_chunk` until a draft is accepted
again) and asks the drafter after each one, trying a proposal it makes with one step.
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


def _read_back(state, sequences, num, width):
  """Appends what was committed since `num` to `sequences`; returns (num, done)."""
  new_BW, new_num, done = jax.device_get(
      _committed_since(state, jax.device_put(np.asarray(num, np.int32)), width))
  for b, seq in enumerate(sequences):
    seq.extend(new_BW[b, :new_num[b] - num[b]].tolist())
  return new_num, done


def generate_host_loop(engine, target_params, drafter_params, state, host_drafter, *,
                       fallback=None, patience: int = 2, chunk: int = 8,
                       max_chunk: int = 128, started: bool = False):
  """Runs `engine.step` until every row is done, proposals coming from `host_drafter`
  (with `fallback`, AR chunks while it stops paying; module docstring). `started`: its
  `start` already saw the prompts (the runner calls it while the device prefills)."""
  tokens, num, done = jax.device_get((state.tokens_BL, state.num_tokens_B, state.done_B))
  sequences = row_tokens(tokens, num)
  if not started:
    host_drafter.start(sequences)
  unpaid, ar_chunk, tried = 0, chunk, False
  while not done.all():
    tokens_BG, num_B = host_drafter.propose(sequences, ~done)
    proposed = np.any(np.asarray(num_B)[~done])
    if fallback is not None and unpaid >= patience and (tried or not proposed):
      # Read back at most what AR committed: ar_chunk tokens per row.
      state = fallback.run(target_params, drafter_params, state, ar_chunk)
      num, done = _read_back(state, sequences, num, ar_chunk)
      ar_chunk, tried = min(2 * ar_chunk, max_chunk), False
      continue
    proposal = jax.device_put(Proposal(np.asarray(tokens_BG, np.int32),
                                       np.asarray(num_B, np.int32)))
    state = engine.step(target_params, drafter_params, state, proposal)
    before = num
    num, done = _read_back(state, sequences, num, engine.num_draft + 1)
    if np.any(num - before > 1):   # a draft was accepted: speculation pays again
      unpaid, ar_chunk, tried = 0, chunk, False
    else:
      unpaid, tried = unpaid + 1, True
  host_drafter.finish(sequences)
  return state
