"""Tree proposers: how a drafter's output becomes a `DraftTree` (`tree_engine.py`).

* `ChainTrees`: the drafter's chain proposal as the degenerate tree (the chain engine's
  acceptance, through the tree path).
* `BlockTopKTrees`: DFlash. One block pass gives every slot's distribution; slot j's
  top-k tokens are the candidates at depth j (the slots are predicted in parallel, so
  every depth-(j-1) node has the same candidates, `best_first_tree`); at T > 0 sampled
  chains from the slots' q.
* `SelectorTrees`: DFlash-2. The same block pass, each node's children ranked by the
  candidate selector given that node's token (the selector walk, as a beam).
* `BeamTrees`: autoregressive drafters (EAGLE-3, MTP, DSpark's Markov walk), EAGLE-2's
  dynamic tree. The drafter's
  `grow_tree` runs one draft step per depth over the beam's nodes, each node with its own
  draft state, and hands each node's distribution to a `TreeGrower`; at T > 0 to a
  `SampledGrower` instead (sampled siblings keep the chain's q-ratio acceptance, which
  deterministic top-k siblings lose).
* `NgramTrees`: the n-gram drafter. The continuations of the `top_k` most recent matches
  of the longest matching suffix, merged into a trie (`trie_tree`); top_k = 1 is the chain.
A `TreeGrower` expands the top-k nodes of each depth into their top-k children, scoring a
path by the product of its draft probabilities (the expected-acceptance score EAGLE-2
ranks by), then keeps the `num_nodes - 1` best of every expanded node.
Trees drafted this way are deterministic functions of the committed prefix, so they are
verified with one-hot sibling q ('deterministic'), exact at every temperature. A
`SampledGrower` tree has a fixed shape and its draws' q, verified 'without_replacement'.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dspec.decoding.tree import DraftTree
from dspec.sampling import processed_probs, sample_from_probs
from dspec.sampling import top_k as top_k_barrier

# Breaks score ties toward shallower nodes, so a node is never kept without its parent
# (a child's score is its parent's plus a log-probability <= 0).
_DEPTH_TIE = 1e-4


class TreeGrower:
  """EAGLE-2's candidate tree over a beam of at most `top_k` nodes per depth.

  The beam starts as the root alone (width 1). `grow` gives each beam node its K
  children; a child scores its parent's score plus its log-probability; the beam becomes
  the best `top_k` children. `tree` reranks every expanded node (the beams' children).
  """

  def __init__(self, batch: int, top_k: int):
    self.top_k = top_k
    self.beam_score_BW = jnp.zeros((batch, 1))
    self.beam_id_BW = jnp.full((batch, 1), -1, jnp.int32)   # candidate index (-1: root)
    self._scores, self._parents, self._tokens, self._depths = [], [], [], []

  def grow(self, tokens_BWK, logp_BWK):
    """Adds beam node w's children `tokens_BWK[:, w]` (log-probabilities `logp_BWK`).
    Returns (beam slot of each new beam node's parent [B, W'], their tokens [B, W'])."""
    b, w, k = tokens_BWK.shape
    offset = sum(s.shape[1] for s in self._scores)
    score_BC = (self.beam_score_BW[:, :, None] + logp_BWK).reshape(b, w * k)
    token_BC = tokens_BWK.reshape(b, w * k).astype(jnp.int32)
    self._scores.append(score_BC)
    self._parents.append(jnp.repeat(self.beam_id_BW, k, axis=1))
    self._tokens.append(token_BC)
    self._depths.append(jnp.full((b, w * k), len(self._scores) - 1, jnp.int32))
    self.beam_score_BW, best_BW = top_k_barrier(score_BC, min(self.top_k, w * k))
    self.beam_id_BW = offset + best_BW
    return best_BW // k, jnp.take_along_axis(token_BC, best_BW, axis=1)

  def expand(self, logits_BWV, token_ids):
    """`grow` by each beam node's top-k tokens under draft-vocabulary logits;
    `token_ids` maps draft-vocabulary indices to target ids."""
    logp_BWV = jax.nn.log_softmax(logits_BWV.astype(jnp.float32), axis=-1)
    logp_BWK, idx_BWK = top_k_barrier(logp_BWV, min(self.top_k, logp_BWV.shape[-1]))
    return self.grow(token_ids(idx_BWK), logp_BWK)

  def tree(self, anchor_B, num_nodes: int) -> DraftTree:
    """The `num_nodes - 1` best-scoring candidates under the anchor, ordered by depth."""
    score_BC, parent_BC, token_BC, depth_BC = (jnp.concatenate(x, axis=1) for x in (
        self._scores, self._parents, self._tokens, self._depths))
    b = score_BC.shape[0]
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
    parent_node = jnp.where(parent_cand < 0, 0, jnp.take_along_axis(
        node_of_BC, jnp.maximum(parent_cand, 0), axis=1))
    pad = num_nodes - 1 - m
    tokens_BN = jnp.concatenate([anchor_B[:, None], jnp.take_along_axis(token_BC, kept_BM, 1),
                                 jnp.zeros((b, pad), jnp.int32)], axis=1).astype(jnp.int32)
    parents_BN = jnp.concatenate([jnp.full((b, 1), -1), parent_node,
                                  jnp.full((b, pad), -1)], axis=1).astype(jnp.int32)
    return DraftTree(tokens_BN, parents_BN, jnp.full((b,), m + 1, jnp.int32))


def chain_lengths(top_k: int, depth: int, budget: int) -> tuple:
  """Lengths of a sampled tree's chains: min(top_k, budget) chains of equal length, as
  deep as `budget` nodes allow (at most `depth`). At T > 0 acceptance falls fast with
  depth, so more root draws beat deeper chains (demo EAGLE-3, 31 nodes: 8 chains of 3 gave
  τ 1.20x the chain's, 4 of 7 1.12x, 8 staggered 7..1 1.17x)."""
  k = max(1, min(top_k, budget))
  return (max(1, min(depth, budget // k)),) * k


class SampledGrower:
  """A sampled tree for T > 0 with `grow_tree`'s `expand` interface: the root's children
  are drawn from its processed draft distribution q without replacement (Gumbel-top-k) and
  every deeper node draws one child from its own q, so the tree is sampled chains of the
  static `lengths` (`chain_lengths`; a fixed shape, as 'without_replacement' verification
  requires). The first chain is the chain proposal's own draw, so τ is at least the
  chain's; the other root children are further chances where it is rejected. Root draws
  past q's support are orphaned with their chains."""

  def __init__(self, ctx, key, lengths, vocab_size: int):
    self.ctx, self.key, self.vocab_size = ctx, key, vocab_size
    # widths[d]: the chains reaching depth d + 1 (the beam after d + 1 expansions)
    self.widths = tuple(sum(n > d for n in lengths) for d in range(max(lengths)))
    self._q, self._tokens, self._valid = [], [], []

  def expand(self, logits_BWV, token_ids):
    b, w, v = logits_BWV.shape
    ctx = self.ctx
    q_BWV = processed_probs(logits_BWV.reshape(b * w, v), ctx.sampling, ctx.temperature,
                            ctx.top_p).reshape(b, w, v)
    d = len(self._q)
    key = jax.random.fold_in(self.key, d)
    width = self.widths[d]
    if d == 0:   # the root: draws without replacement
      logq_BV = jnp.where(q_BWV[:, 0] > 0, jnp.log(jnp.maximum(q_BWV[:, 0], 1e-38)), -jnp.inf)
      gumbel_BV = jax.random.gumbel(key, logq_BV.shape)
      score_BK, idx_BK = top_k_barrier(logq_BV + gumbel_BV, min(width, v))
      valid_BK = jnp.isfinite(score_BK)
      parent_BK = jnp.zeros(idx_BK.shape, jnp.int32)
    else:        # the first `width` chains go one deeper
      idx_BK = sample_from_probs(key, q_BWV[:, :width].reshape(b * width, v)).reshape(b, width)
      valid_BK = self._valid[-1][:, :width]
      parent_BK = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (b, width))
    full_BWV = jnp.zeros((b, w, self.vocab_size), jnp.float32).at[
        :, :, token_ids(jnp.arange(v))].set(q_BWV)
    tokens_BK = token_ids(idx_BK)
    self._q.append(full_BWV)
    self._tokens.append(tokens_BK)
    self._valid.append(valid_BK)
    return parent_BK, tokens_BK

  def tree(self, anchor_B, num_nodes: int) -> DraftTree:
    """Nodes depth by depth, chain i's node at index i of its depth (its parent: the same
    chain's node one depth up, the root at depth 1); q of each node's children."""
    b = anchor_B.shape[0]
    widths = [w for w, _ in zip(self.widths, self._tokens)]
    n = 1 + sum(widths)
    assert n <= num_nodes, (n, num_nodes)
    offsets = [1 + sum(widths[:d]) for d in range(len(widths))]
    parents_N = jnp.concatenate([jnp.asarray([-1], jnp.int32)] + [
        jnp.zeros((w,), jnp.int32) if d == 0 else offsets[d - 1] + jnp.arange(w, dtype=jnp.int32)
        for d, w in enumerate(widths)])
    valid_BN = jnp.concatenate([jnp.ones((b, 1), bool)] + self._valid, axis=1)
    parents_BN = jnp.where(valid_BN, parents_N[None, :], -1)
    tokens_BN = jnp.concatenate([anchor_B[:, None]] + self._tokens, axis=1).astype(jnp.int32)
    # q_BNV[:, m]: node m's children distribution (the root's, then each depth's nodes).
    q_BNV = jnp.concatenate(self._q + [jnp.zeros((b, widths[-1], self.vocab_size),
                                                 jnp.float32)], axis=1)
    pad = num_nodes - n
    return DraftTree(
        jnp.pad(tokens_BN, ((0, 0), (0, pad))),
        jnp.pad(parents_BN, ((0, 0), (0, pad)), constant_values=-1),
        jnp.full((b,), n, jnp.int32),
        jnp.pad(q_BNV, ((0, 0), (0, pad), (0, 0))), 'without_replacement')


def best_first_tree(anchor_B, tokens_BGK, logp_BGK, num_nodes: int) -> DraftTree:
  """Tree of the `num_nodes - 1` best-scoring paths over per-depth candidates: depth j + 1
  offers candidates `tokens_BGK[:, j]` with log-probabilities `logp_BGK[:, j]` under
  every beam node of depth j (`TreeGrower` with a beam of K)."""
  b, g, k = tokens_BGK.shape
  grower = TreeGrower(b, k)
  for j in range(g):
    w = grower.beam_id_BW.shape[1]
    grower.grow(jnp.broadcast_to(tokens_BGK[:, j, None], (b, w, k)),
                jnp.broadcast_to(logp_BGK[:, j, None], (b, w, k)))
  return grower.tree(anchor_B, num_nodes)


def trie_tree(anchor_B, paths_BKG, valid_BK, num_nodes: int) -> DraftTree:
  """The trie of the valid paths under the anchor, earlier paths first: path k's node at
  depth j + 1 is that of the first valid path with the same first j + 1 tokens. Nodes are
  numbered path by path, depth by depth (so a parent precedes its children) and the first
  `num_nodes - 1` are kept; the tree has min(num_nodes, 1 + K * G) nodes."""
  b, k, g = paths_BKG.shape
  n_out = min(num_nodes, 1 + k * g)
  same_BKKG = jnp.cumprod(paths_BKG[:, :, None] == paths_BKG[:, None, :], axis=-1,
                          dtype=jnp.int32) > 0
  same_BKKG &= valid_BK[:, None, :, None]
  owner_BKG = jnp.argmax(same_BKKG, axis=2)   # the first valid path sharing the prefix
  new_BKG = valid_BK[:, :, None] & (owner_BKG == jnp.arange(k)[None, :, None])
  node_BKG = jnp.cumsum(new_BKG.reshape(b, k * g), axis=1, dtype=jnp.int32).reshape(b, k, g)
  rows = jnp.arange(b)[:, None, None]
  parent_BKG = jnp.concatenate([
      jnp.zeros((b, k, 1), jnp.int32),
      node_BKG[rows, owner_BKG[:, :, :-1], jnp.arange(g - 1)[None, None, :]]], axis=2)
  at_BKG = jnp.where(new_BKG & (node_BKG < n_out), node_BKG, n_out)   # n_out: dropped
  tokens_BN = jnp.zeros((b, n_out), jnp.int32).at[rows, at_BKG].set(
      paths_BKG.astype(jnp.int32), mode='drop').at[:, 0].set(anchor_B.astype(jnp.int32))
  parents_BN = jnp.full((b, n_out), -1, jnp.int32).at[rows, at_BKG].set(
      parent_BKG, mode='drop')
  num_nodes_B = 1 + jnp.minimum(jnp.sum(new_BKG, axis=(1, 2), dtype=jnp.int32), n_out - 1)
  return DraftTree(tokens_BN, parents_BN, num_nodes_B)


def block_pass(drafter, params, state, target, ctx):
  """(the merged block drafter, its hidden [B, G, D] for [anchor, MASK x G]): the one pass
  a DFlash / DFlash-2 tree is drafted from."""
  model = nnx.merge(drafter.graphdef, params)
  masks_BG = jnp.full((ctx.tokens_BL.shape[0], drafter.num_draft),
                      drafter.config.mask_token_id, jnp.int32)
  return model, drafter.block_hidden(model, state.cache, target, ctx, masks_BG)


def anchor_of(ctx):
  """The last committed token of every row (node 0 of its tree)."""
  return ctx.tokens_BL[jnp.arange(ctx.tokens_BL.shape[0]), ctx.num_tokens_B - 1]


@dataclasses.dataclass(frozen=True)
class ChainTrees:
  """The drafter's chain proposal as a tree of 1 + num_draft nodes."""

  def propose_tree(self, drafter, params, state, target, ctx, key, num_nodes):
    proposal = drafter.propose(params, state, target, ctx, key)
    g = min(num_nodes - 1, proposal.tokens_BG.shape[1])
    q_BGV = None if proposal.q_BGV is None else proposal.q_BGV[:, :g]
    return DraftTree.chain(anchor_of(ctx), proposal.tokens_BG[:, :g],
                           jnp.minimum(proposal.num_proposed_B, g), q_BGV)


@dataclasses.dataclass(frozen=True)
class BlockTopKTrees:
  """DFlash trees from one block pass: per-slot top-k (`best_first_tree`) at T = 0, and
  at T > 0 sampled chains whose depth-j nodes draw from slot j's q (`SampledGrower`)."""

  top_k: int = 8

  def propose_tree(self, drafter, params, state, target, ctx, key, num_nodes):
    model, hidden_BGD = block_pass(drafter, params, state, target, ctx)
    b = hidden_BGD.shape[0]
    logits_BGV = model.draft_logits(target, hidden_BGD)
    if not ctx.sampling.greedy:   # sampled chains, slot j's q at depth j (`SampledGrower`)
      lengths = chain_lengths(self.top_k, drafter.num_draft, num_nodes - 1)
      grower = SampledGrower(ctx, key, lengths, target.cfg.vocab_size)
      for j in range(max(lengths)):
        w = 1 if j == 0 else grower.widths[j - 1]
        grower.expand(jnp.broadcast_to(logits_BGV[:, j, None], (b, w, logits_BGV.shape[2])),
                      model.token_ids)
      return grower.tree(anchor_of(ctx), num_nodes)
    logp_BGV = jax.nn.log_softmax(logits_BGV, axis=-1)
    logp_BGK, idx_BGK = top_k_barrier(logp_BGV, min(self.top_k, logp_BGV.shape[-1]))
    return best_first_tree(anchor_of(ctx), model.token_ids(idx_BGK), logp_BGK, num_nodes)


@dataclasses.dataclass(frozen=True)
class SelectorTrees:
  """DFlash-2 trees: depth j offers slot j's K selector candidates, each node's children
  scored by the selector's S given that node's token (log-softmax over the K, as the
  walk samples them), grown as EAGLE-2's beam (`TreeGrower`). top_k = 1 is the greedy
  walk, i.e. DFlash-2's chain proposal at T = 0."""

  top_k: int = 8

  def propose_tree(self, drafter, params, state, target, ctx, key, num_nodes):
    del key
    model, hidden_BGD = block_pass(drafter, params, state, target, ctx)
    selector = model.candidate_selector
    b = hidden_BGD.shape[0]
    unary_BGK, cand_BGK = top_k_barrier(
        model.draft_logits(target, hidden_BGD).astype(jnp.float32), model.cfg.selector_top_k)
    cand_BGK = cand_BGK.astype(jnp.int32)
    g_BGR = selector.hidden_projection(hidden_BGD)
    k = cand_BGK.shape[2]
    grower = TreeGrower(b, self.top_k)
    prev_BW = anchor_of(ctx)[:, None]   # the walk's predecessor of slot 1
    for j in range(max(1, min(drafter.num_draft, num_nodes - 1))):
      w = prev_BW.shape[1]
      cand_BWK = jnp.broadcast_to(cand_BGK[:, j, None], (b, w, k))
      s_BWK = unary_BGK[:, j, None] + selector.pair_scores(
          jnp.broadcast_to(g_BGR[:, j, None], (b, w, g_BGR.shape[2])), prev_BW, cand_BWK)
      logp_BWk, pick_BWk = top_k_barrier(jax.nn.log_softmax(s_BWK, axis=-1),
                                         min(self.top_k, k))
      _, prev_BW = grower.grow(jnp.take_along_axis(cand_BWK, pick_BWk, axis=2), logp_BWk)
    tree = grower.tree(anchor_of(ctx), num_nodes)   # candidates in draft-vocab ids
    return tree.replace(tokens_BN=tree.tokens_BN.at[:, 1:].set(
        model.token_ids(tree.tokens_BN[:, 1:])))


@dataclasses.dataclass(frozen=True)
class BeamTrees:
  """EAGLE-2's dynamic trees: `drafter.grow_tree(params, state, target, ctx, grower,
  depth)` expands a `TreeGrower` one draft step per depth, up to the drafter's num_draft
  (and never deeper than the tree has nodes; one depth at least)."""

  top_k: int = 8

  def propose_tree(self, drafter, params, state, target, ctx, key, num_nodes):
    if ctx.sampling.greedy:
      grower = TreeGrower(ctx.tokens_BL.shape[0], self.top_k)
      depth = max(1, min(drafter.num_draft, num_nodes - 1))
    else:
      lengths = chain_lengths(self.top_k, drafter.num_draft, num_nodes - 1)
      grower = SampledGrower(ctx, key, lengths, target.cfg.vocab_size)
      depth = max(lengths)
    drafter.grow_tree(params, state, target, ctx, grower, depth)
    return grower.tree(anchor_of(ctx), num_nodes)


@dataclasses.dataclass(frozen=True)
class NgramTrees:
  """N-gram trees: `drafter.recent_matches` (the `top_k` most recent matches of the
  longest matching suffix) and their `drafter.continuations` as a `trie_tree`, most
  recent match first (its whole continuation is the chain proposal)."""

  top_k: int = 8

  def propose_tree(self, drafter, params, state, target, ctx, key, num_nodes):
    del params, state, target, key
    ends_BK = drafter.recent_matches(ctx.tokens_BL, ctx.num_tokens_B, self.top_k)
    paths_BKG = drafter.continuations(ctx.tokens_BL, ctx.num_tokens_B, ends_BK)
    return trie_tree(anchor_of(ctx), paths_BKG, ends_BK >= 0, num_nodes)
