"""Tree verification: greedy longest match and lossless multi-candidate rejection sampling.

Both return `(num_accepted_B, path_BD1, emitted_BD1)` for trees of depth <= D: `path`
holds the node ids of the root and the n accepted nodes (entries past n: 0), `emitted`
the n accepted tokens then the bonus or corrected token at index n, as the chain's
`verification.py` (its emitted tokens with a chain tree are the same).

Greedy (T = 0): a node is on target when its token is the target argmax at its parent and
its parent is on target (the root is); the deepest such node is accepted with its path
(ties between duplicate siblings: the lower node id) and the argmax at it is emitted.
Every emitted token is the argmax given its prefix, so the output equals AR decoding.

Sampling (T > 0), with p the target's processed (temperature / top-k / top-p) rows.
Walk from the root; at node u with children c_1..c_k (node order) and target p_u:

    r_1 = p_u;  for i = 1..k:  accept c_i if coin_i · q'_i(c_i) < r_i(c_i), then go to c_i;
                               else r_{i+1} = norm(max(r_i - q'_i, 0)).
    No child accepted: emit y ~ r_{k+1} and stop (a leaf emits the bonus y ~ p_u).

where q'_i is the distribution c_i was drawn from given what came before it:
* 'with_replacement' (SpecInfer's multi-step speculative sampling, c_i i.i.d. q_u):
  q'_i = q_u;
* 'without_replacement' (recursive rejection sampling without replacement, Jeon et al.
  2024; e.g. Gumbel-top-k of log q_u): q'_i = q_u without c_1..c_{i-1}, renormalised;
* 'deterministic' (fixed tokens such as a top-k, or any tree at all): q'_i = one_hot(c_i),
  i.e. accept with probability r_i(c_i), else remove c_i from r_i. (Scoring a top-k
  sibling with q_u itself is NOT exact: with p = q = (½, ½) the top-1 token would always
  be accepted.)

Proof sketch. Lemma: let G be what is known before coin_i, with q'_i, r_i G-measurable
and c_i ~ q'_i given G (for one-hot q'_i put c_i into G: any c_i qualifies). If the
continuation after a rejection emits a sample of r_{i+1} = norm(max(r_i - q'_i, 0))
(G-measurable: it does not depend on c_i beyond q'_i), the step emits a sample of r_i:
    P(y | G) = min(q'_i(y), r_i(y)) + (1 - Σ_z min(q'_i(z), r_i(z))) · r_{i+1}(y) = r_i(y),
because Σ_z max(r_i - q'_i, 0)(z) = 1 - Σ_z min(q'_i, r_i)(z). (When that mass is 0 a
rejection has probability 0.) Backward induction over i = k..1 (the last step's
continuation is the sample y ~ r_{k+1}) gives: the token chosen at u is a sample of
p_u given the path to u. Over the levels: the token chosen at the root is ~ p(· | prefix);
if it is an accepted child c the walk continues at c, whose target row is p(· | prefix,
path to c) (the tree mask makes c see exactly its ancestors), so the next token is ~ that;
a residual or bonus sample ends the step, and the next step drafts afresh from the longer
prefix. By the chain rule the committed tokens follow the target's joint distribution at
every temperature / top-p (top-p only changes p). The coins are fresh uniforms per node.
Requirement on the drafter for the two sampled modes: given the path to u (and the
sibling sets along it), the children of u are drawn from q_u as stated, with their
number fixed or a function of that path. A tree shaped by draws elsewhere (EAGLE-2
reranking of sampled nodes) must use 'deterministic', which is exact for any tree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspec.decoding.tree import DraftTree
from dspec.decoding.verification import first_argmax
from dspec.sampling import SamplingSpec, processed_probs, sample_from_probs


def _path_to(tree: DraftTree, node_B, max_depth: int):
  """[B, D + 1] node ids of the path root..node (entries past its depth: 0)."""
  anc_BN = jnp.take_along_axis(tree.ancestors_BNN(), node_B[:, None, None], axis=1)[:, 0]
  depth_BN = tree.depths_BN()
  d = jnp.arange(max_depth + 1, dtype=jnp.int32)
  hit_BDN = anc_BN[:, None, :] & (depth_BN[:, None, :] == d[None, :, None])
  return jnp.argmax(hit_BDN, axis=-1).astype(jnp.int32)


def greedy_tree_verify(tree: DraftTree, logits_BNV, max_depth: int):
  """Deepest node whose whole path matches the target argmax (see the module doc)."""
  argmax_BN = first_argmax(logits_BNV)
  parents = jnp.where(tree.valid_BN(), tree.parents_BN, -1)
  match_BN = (parents >= 0) & (
      tree.tokens_BN == jnp.take_along_axis(argmax_BN, jnp.maximum(parents, 0), axis=1))
  match_BN = match_BN.at[:, 0].set(True)
  anc_BNN = tree.ancestors_BNN()
  on_target_BN = jnp.all(~anc_BNN | match_BN[:, None, :], axis=-1)
  depth_BN = jnp.where(on_target_BN, tree.depths_BN(), -1)
  depth_BN = jnp.where(depth_BN <= max_depth, depth_BN, -1)
  best_B = jnp.argmax(depth_BN, axis=1).astype(jnp.int32)   # first of the deepest
  n_B = jnp.take_along_axis(depth_BN, best_B[:, None], axis=1)[:, 0]
  path_BD1 = _path_to(tree, best_B, max_depth)
  return n_B, path_BD1, _emitted(tree, path_BD1, n_B,
                                 jnp.take_along_axis(argmax_BN, best_B[:, None], axis=1)[:, 0])


def _emitted(tree: DraftTree, path_BD1, n_B, last_B):
  """Tokens of path nodes 1..n, then `last` at index n (0 past it)."""
  j = jnp.arange(path_BD1.shape[1])[None, :]
  tokens = jnp.take_along_axis(tree.tokens_BN, jnp.roll(path_BD1, -1, axis=1), axis=1)
  out = jnp.where(j < n_B[:, None], tokens, jnp.where(j == n_B[:, None], last_B[:, None], 0))
  return out.astype(jnp.int32)


def _normalised(x_BV, fallback_BV):
  mass = jnp.sum(x_BV, axis=-1, keepdims=True)
  return jnp.where(mass > 0, x_BV / jnp.maximum(mass, 1e-30), fallback_BV)


def rejection_tree_verify(key, tree: DraftTree, logits_BNV, probs_fn, max_depth: int):
  """Multi-candidate speculative sampling on `probs_fn(logits)` rows (see the module doc).

  `probs_fn` maps target rows [B, V] to processed probabilities; it runs only on the rows
  the walk visits (one per level). `tree.q_BNV` must be processed the same way as the
  draft distributions the children were drawn from. Nodes deeper than `max_depth` are
  never reached (a node at that depth is treated as a leaf).
  """
  b, n = tree.tokens_BN.shape
  rows = jnp.arange(b)
  draw = tree.sibling_draw
  key_coin, key_emit = jax.random.split(key)
  coin_BN = jax.random.uniform(key_coin, (b, n), jnp.float32)
  children_BNK = tree.children_BNK()
  num_children = children_BNK.shape[-1]

  def child_at(k, u_B):
    return children_BNK[rows, u_B, jnp.minimum(k, num_children - 1)]

  def sibling(c):
    """Tests the k-th child at every open row: accept it, or update r (and q')."""
    k, u_B, open_B, r_BV, q_BV, chosen_B = c
    child_B = child_at(k, u_B)
    testing_B = open_B & (child_B >= 0)
    child = jnp.maximum(child_B, 0)
    x_B = tree.tokens_BN[rows, child]
    one_hot = jax.nn.one_hot(x_B, r_BV.shape[-1], dtype=r_BV.dtype)
    q_step = one_hot if draw == 'deterministic' else q_BV
    accept_B = testing_B & (coin_BN[rows, child] * jnp.sum(q_step * one_hot, axis=-1)
                            < r_BV[rows, x_B])
    reject = (testing_B & ~accept_B)[:, None]
    r_BV = jnp.where(reject, _normalised(jnp.maximum(r_BV - q_step, 0.0), r_BV), r_BV)
    if draw == 'without_replacement':
      q_BV = jnp.where(reject, _normalised(q_BV * (1 - one_hot), q_BV), q_BV)
    return (k + 1, u_B, testing_B & ~accept_B, r_BV, q_BV,
            jnp.where(accept_B, child_B, chosen_B))

  def level(c):
    d, u_B, live_B, n_B, path_BD1, out_BD1 = c
    p_BV = probs_fn(logits_BNV[rows, u_B])
    q_BV = p_BV if tree.q_BNV is None else tree.q_BNV[rows, u_B].astype(p_BV.dtype)
    more = lambda s: (s[0] < num_children) & jnp.any(s[2] & (child_at(s[0], s[1]) >= 0))
    init = (jnp.int32(0), u_B, live_B & (n_B < max_depth), p_BV, q_BV,
            jnp.full((b,), -1, jnp.int32))
    _, _, _, r_BV, _, chosen_B = jax.lax.while_loop(more, sibling, init)
    accepted_B = chosen_B >= 0
    y_B = sample_from_probs(jax.random.fold_in(key_emit, d), r_BV)
    token_B = jnp.where(accepted_B, tree.tokens_BN[rows, jnp.maximum(chosen_B, 0)], y_B)
    out_BD1 = out_BD1.at[rows, jnp.where(live_B, n_B, max_depth + 1)].set(token_B,
                                                                           mode='drop')
    path_BD1 = path_BD1.at[rows, jnp.where(accepted_B, n_B + 1, max_depth + 1)].set(
        chosen_B, mode='drop')
    return (d + 1, jnp.where(accepted_B, chosen_B, u_B), accepted_B, n_B + accepted_B,
            path_BD1, out_BD1)

  zeros = jnp.zeros((b, max_depth + 1), jnp.int32)
  init = (jnp.int32(0), jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool),
          jnp.zeros((b,), jnp.int32), zeros, zeros)
  _, _, _, n_B, path_BD1, out_BD1 = jax.lax.while_loop(lambda c: jnp.any(c[2]), level, init)
  return n_B, path_BD1, out_BD1


def verify_tree(key, tree: DraftTree, logits_BNV, spec: SamplingSpec, temperature, top_p,
                max_depth: int):
  """Greedy or lossless sampling verification of `tree` against the target rows
  `logits_BNV` (one per node, from the tree-masked forward)."""
  if spec.greedy:
    return greedy_tree_verify(tree, logits_BNV, max_depth)
  return rejection_tree_verify(
      key, tree, logits_BNV, lambda x: processed_probs(x, spec, temperature, top_p),
      max_depth)
