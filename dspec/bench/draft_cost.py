"""Cost of one draft pass against one target verify pass, measured in one process.

Both are jitted, warmed up and timed as medians of interleaved repeats on the decode state
after prefilling a real prompt: `propose` (everything the drafter does to produce its
γ drafts) against the target's forward over the γ+1 verify tokens with its cache (what one
speculative step verifies), plus `update` (the drafter's per-step bookkeeping, e.g. the
DFlash context K/V append or the MTP catch-up). `tree_vs_chain_verify` prices a tree
verify pass against chains; `verify_curve` the verify pass over k tokens against one AR
step (k = 1), the curve that decides whether speculation can pay: flat where decoding is
memory-bound, near k where it is compute-bound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dspec.bench.timing import median_times
from dspec.decoding.tree import DraftTree
from dspec.decoding.tree_engine import tree_forward


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


def tree_vs_chain_verify(target_graphdef, target_params, cache, num_nodes: int,
                         chain_tokens: int, taps=(), repeats: int = 20) -> dict:
  """Seconds per target verify pass over a `num_nodes`-node tree (4 children per node,
  breadth first: the shape of a top-4 tree; ancestors-only mask, positions by depth)
  against a chain of `chain_tokens` tokens and a chain of `num_nodes` tokens, on `cache`."""
  b = cache.lengths_B.shape[0]
  parents = jnp.concatenate([jnp.array([-1]), jnp.arange(num_nodes - 1) // 4]).astype(
      jnp.int32)
  tree = DraftTree(jnp.zeros((b, num_nodes), jnp.int32), jnp.tile(parents, (b, 1)),
                   jnp.full((b,), num_nodes, jnp.int32))

  @jax.jit
  def verify_tree(tparams, cache, tree):
    out = tree_forward(nnx.merge(target_graphdef, tparams), tree, cache, taps)
    return out.logits_BTV

  @jax.jit
  def verify_chain(tparams, cache, tokens_BT):
    return nnx.merge(target_graphdef, tparams)(tokens_BT, cache=cache, taps=taps).logits_BTV

  short, same = (jnp.zeros((b, n), jnp.int32) for n in (chain_tokens, num_nodes))
  t_tree, t_short, t_same = median_times([
      lambda: verify_tree(target_params, cache, tree),
      lambda: verify_chain(target_params, cache, short),
      lambda: verify_chain(target_params, cache, same)], repeats)
  return {'tree_nodes': num_nodes, 'chain_tokens': chain_tokens, 'batch_size': b,
          'tree_verify_s': t_tree, 'chain_verify_s': t_short,
          'same_count_chain_verify_s': t_same, 'tree_over_chain': t_tree / t_short,
          'tree_over_same_count_chain': t_tree / t_same}


def verify_curve(target_graphdef, target_params, cache, widths=(1, 2, 4, 8, 16, 32),
                 taps=(), repeats: int = 20) -> dict:
  """Seconds per target forward over k tokens with `cache` for each k in `widths`, and
  each over the k = 1 forward (an AR step)."""
  b = cache.lengths_B.shape[0]

  @jax.jit
  def forward(tparams, cache, tokens_BT):
    return nnx.merge(target_graphdef, tparams)(tokens_BT, cache=cache, taps=taps).logits_BTV

  widths = sorted(set(widths) | {1})
  times = median_times([lambda k=k: forward(target_params, cache,
                                            jnp.zeros((b, k), jnp.int32)) for k in widths],
                       repeats)
  one = times[widths.index(1)]
  return {'batch_size': b, 'seconds': dict(zip(widths, times)),
          'over_ar_step': {k: t / one for k, t in zip(widths, times)}}
