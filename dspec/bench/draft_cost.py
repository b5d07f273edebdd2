"""Cost of one draft pass against one target verify pass, measured in one process.

Both are jitted, warmed up and timed as medians of interleaved repeats on the decode state
after prefilling a real prompt: `propose` (everything the drafter does to produce its
γ drafts) against the target's forward over the γ+1 verify tokens with its cache (what one
speculative step verifies), plus `update` (the drafter's per-step bookkeeping, e.g. the
DFlash context K/V append or the MTP catch-up).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dspec.bench.timing import median_times


def draft_vs_verify(engine, target_params, drafter_params, state, repeats: int = 20) -> dict:
  """Seconds per propose / update / verify on `state` (a prefilled `DecodeState`)."""
  drafter = engine.drafter

  @jax.jit
  def propose(dparams, tparams, state):
    return drafter.propose(dparams, state.drafter_state,
                           nnx.merge(engine.target_graphdef, tparams), engine.context(state),
                           jax.random.key(0)).tokens_BG

  @jax.jit
  def verify(tparams, cache, verify_BG1):
    out = nnx.merge(engine.target_graphdef, tparams)(verify_BG1, cache=cache,
                                                     taps=drafter.taps)
    return out.logits_BTV, out.taps_BTND

  @jax.jit
  def update(dparams, tparams, state, verify_BG1):
    target = nnx.merge(engine.target_graphdef, tparams)
    cache = state.cache
    out = target(verify_BG1, cache=cache, taps=drafter.taps)
    return drafter.update(dparams, state.drafter_state, target, engine.context(state), out,
                          cache.lengths_B, jnp.zeros_like(cache.lengths_B))

  b = state.tokens_BL.shape[0]
  verify_BG1 = jnp.zeros((b, drafter.num_draft + 1), jnp.int32)
  t_propose, t_verify, t_verify_update = median_times([
      lambda: propose(drafter_params, target_params, state),
      lambda: verify(target_params, state.cache, verify_BG1),
      lambda: update(drafter_params, target_params, state, verify_BG1),
  ], repeats)
  t_update = max(0.0, t_verify_update - t_verify)
  return {'num_draft': drafter.num_draft, 'batch_size': b,
          'propose_s': t_propose, 'verify_s': t_verify, 'update_s': t_update,
          'propose_over_verify': t_propose / t_verify,
          'draft_over_verify': (t_propose + t_update) / t_verify}
