"""Tree proposers: how a drafter's output becomes a `DraftTree` (`tree_engine.py`).

* `ChainTrees`: the drafter's chain proposal as the degenerate tree (the chain engine's
  acceptance, through the tree path).
* `BlockTopKTrees`: DFlash / DFlash-2 block drafters. One block pass gives every slot's
  distribution; slot j's top-k tokens are the candidates at depth j (the slots are
  predicted in parallel, so every depth-(j-1) node has the same candidates).
  `best_first_tree` keeps the `num_nodes - 1` paths with the highest draft probability
  product, the expected-acceptance score EAGLE-2 ranks by.
Trees drafted this way are deterministic functions of the committed prefix, so they are
verified with one-hot sibling q ('deterministic'), exact at every temperature.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dspec.decoding.tree import DraftTree
from dspec.sampling import top_k as top_k_barrier

# Breaks score ties toward shallower nodes, so a node is never kept without its parent
# (a child's score is its parent's plus a log-probability <= 0).
_DEPTH_TIE = 1e-4


def best_first_tree(anchor_B, tokens_BGK, logp_BGK, num_nodes: int) -> DraftTree:
  """Tree of the `num_nodes - 1` best-scoring paths over per-depth candidates.

  Depth j + 1 offers candidates `tokens_BGK[:, j]` with log-probabilities `logp_BGK[:, j]`
  under every kept depth-j node; a path's score is the sum of its nodes' log-probabilities.
  Expansion keeps a beam of K nodes per depth (EAGLE-2's top-k per depth), then all
  expanded nodes are reranked and the best `num_nodes - 1` kept, ordered by depth.
  """
  b, g, k = tokens_BGK.shape
  scores, parents, tokens, depths = [logp_BGK[:, 0]], [jnp.full((b, k), -1)], \
      [tokens_BGK[:, 0]], [jnp.zeros((b, k), jnp.int32)]
  beam_score, beam_id = logp_BGK[:, 0], jnp.broadcast_to(jnp.arange(k), (b, k))
  offset = k
  for j in range(1, g):
    child_BKK = beam_score[:, :, None] + logp_BGK[:, j, None, :]
    scores.append(child_BKK.reshape(b, k * k))
    parents.append(jnp.repeat(beam_id, k, axis=1))
    tokens.append(jnp.tile(tokens_BGK[:, j], (1, k)))
    depths.append(jnp.full((b, k * k), j, jnp.int32))
    beam_score, best = top_k_barrier(scores[-1], k)
    beam_id = offset + best
    offset += k * k
  score_BC, parent_BC, token_BC, depth_BC = (jnp.concatenate(x, axis=1) for x in
                                             (scores, parents, tokens, depths))
  m = min(num_nodes - 1, score_BC.shape[1])
  _, kept_BM = top_k_barrier(score_BC - _DEPTH_TIE * depth_BC, m)
  # Topological order: by depth (parents are shallower), stable within a depth.
  kept_BM = jnp.take_along_axis(
      kept_BM, jnp.argsort(jnp.take_along_axis(depth_BC, kept_BM, axis=1), axis=1,
                           stable=True), axis=1)
  rows = jnp.arange(b)[:, None]
  node_of_BC = jnp.zeros(score_BC.shape, jnp.int32).at[rows, kept_BM].set(
      jnp.arange(1, m + 1, dtype=jnp.int32)[None])
  parent_cand = jnp.take_along_axis(parent_BC, kept_BM, axis=1)
  parent_node = jnp.where(parent_cand < 0, 0,
                          jnp.take_along_axis(node_of_BC, jnp.maximum(parent_cand, 0), axis=1))
  pad = num_nodes - 1 - m
  tokens_BN = jnp.concatenate([anchor_B[:, None], jnp.take_along_axis(token_BC, kept_BM, 1),
                               jnp.zeros((b, pad), jnp.int32)], axis=1).astype(jnp.int32)
  parents_BN = jnp.concatenate([jnp.full((b, 1), -1), parent_node,
                                jnp.full((b, pad), -1)], axis=1).astype(jnp.int32)
  return DraftTree(tokens_BN, parents_BN, jnp.full((b,), m + 1, jnp.int32))


@dataclasses.dataclass(frozen=True)
class ChainTrees:
  """The drafter's chain proposal as a tree of 1 + num_draft nodes."""

  def propose_tree(self, drafter, params, state, target, ctx, key, num_nodes):
    proposal = drafter.propose(params, state, target, ctx, key)
    g = min(num_nodes - 1, proposal.tokens_BG.shape[1])
    q_BGV = None if proposal.q_BGV is None else proposal.q_BGV[:, :g]
    anchor_B = ctx.tokens_BL[jnp.arange(ctx.tokens_BL.shape[0]), ctx.num_tokens_B - 1]
    return DraftTree.chain(anchor_B, proposal.tokens_BG[:, :g],
                           jnp.minimum(proposal.num_proposed_B, g), q_BGV)


@dataclasses.dataclass(frozen=True)
class BlockTopKTrees:
  """Per-slot top-k trees from one DFlash / DFlash-2 block pass (`best_first_tree`)."""

  top_k: int = 4

  def propose_tree(self, drafter, params, state, target, ctx, key, num_nodes):
    del key
    model = nnx.merge(drafter.graphdef, params)
    b = ctx.tokens_BL.shape[0]
    masks_BG = jnp.full((b, drafter.num_draft), drafter.config.mask_token_id, jnp.int32)
    hidden_BGD = drafter.block_hidden(model, state.cache, target, ctx, masks_BG)
    logp_BGV = jax.nn.log_softmax(model.draft_logits(target, hidden_BGD), axis=-1)
    logp_BGK, idx_BGK = top_k_barrier(logp_BGV, min(self.top_k, logp_BGV.shape[-1]))
    anchor_B = ctx.tokens_BL[jnp.arange(b), ctx.num_tokens_B - 1]
    return best_first_tree(anchor_B, model.token_ids(idx_BGK), logp_BGK, num_nodes)
