"""Draft token trees: several candidate continuations verified in one target pass.

A `DraftTree` holds N padded nodes per row. Node 0 is the root: the anchor (the last
committed token, not yet in the target cache), whose target row predicts depth 1. Every
other real node n (1 <= n < num_nodes) has a parent 0 <= parents[n] < n, so node order is
topological and a node's ancestors come before it. A chain of γ drafts is the degenerate
tree with parents[n] = n - 1 (`DraftTree.chain`).

In the verify pass node n sits at position start + depth[n] (RoPE) and writes its K/V
into cache slot start + n; it attends to the committed prefix (slots < start) and to its
ancestors and itself (`attention_mask_BNS`). After acceptance only the accepted path's
K/V is kept, moved to slots start + 0..n (`compact_path`). Acceptance (greedy and
lossless sampling) is in `tree_verification.py`.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dspec.models.kv_cache import KVCache

SIBLING_DRAWS = ('deterministic', 'with_replacement', 'without_replacement')


@struct.dataclass
class DraftTree:
  """A padded token tree per row.

  tokens_BN: int32 token of each node (node 0: the anchor). parents_BN: int32 parent
  index, -1 for the root and for padding (nodes >= num_nodes_B). q_BNV: the (processed)
  draft distribution node n's children were drawn from; None when every sibling set is
  deterministic. sibling_draw (static) says how the children of a node were chosen
  (`tree_verification`): 'deterministic' (fixed tokens, e.g. top-k; q unused),
  'with_replacement' (i.i.d. from q_n) or 'without_replacement' (sequentially from q_n,
  each draw excluding the earlier siblings). Siblings are ordered by node index.
  """

  tokens_BN: jax.Array
  parents_BN: jax.Array
  num_nodes_B: jax.Array
  q_BNV: Optional[jax.Array] = None
  sibling_draw: str = struct.field(pytree_node=False, default='deterministic')

  @property
  def num_nodes(self) -> int:
    """N, the padded node count (static)."""
    return self.tokens_BN.shape[1]

  @classmethod
  def chain(cls, anchor_B, drafts_BG, num_proposed_B, q_BGV=None) -> 'DraftTree':
    """The chain [anchor, d_1..d_γ] (node j + 1 is d_j's child): `q_BGV[:, j]`, the
    distribution d_{j+1} was drawn from, is node j's children distribution."""
    b, g = drafts_BG.shape
    n = jnp.arange(g + 1, dtype=jnp.int32)
    num_nodes_B = 1 + jnp.clip(num_proposed_B, 0, g).astype(jnp.int32)
    parents_BN = jnp.where(n[None, :] < num_nodes_B[:, None], n - 1, -1)
    tokens_BN = jnp.concatenate([anchor_B[:, None], drafts_BG], axis=1).astype(jnp.int32)
    q_BNV = None
    if q_BGV is not None:
      q_BNV = jnp.concatenate([q_BGV, jnp.zeros_like(q_BGV[:, :1])], axis=1)
    draw = 'deterministic' if q_BGV is None else 'with_replacement'
    return cls(tokens_BN, parents_BN.astype(jnp.int32), num_nodes_B, q_BNV, draw)

  def valid_BN(self) -> jax.Array:
    return jnp.arange(self.num_nodes)[None, :] < self.num_nodes_B[:, None]

  def ancestors_BNN(self) -> jax.Array:
    """[B, N, N] bool: m is an ancestor of n or n itself (every node, padding included,
    is its own ancestor, so no attention row is empty)."""
    n = self.num_nodes
    parents = jnp.where(self.valid_BN(), self.parents_BN, -1)
    rows = jnp.arange(parents.shape[0])[:, None]

    def up(_, c):
      node_BN, anc_BNN = c
      node_BN = jnp.where(node_BN >= 0, parents[rows, jnp.maximum(node_BN, 0)], -1)
      hit = jax.nn.one_hot(node_BN, n, dtype=bool)   # -1 -> all False
      return node_BN, anc_BNN | hit

    start = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), parents.shape)
    eye = jnp.broadcast_to(jnp.eye(n, dtype=bool), parents.shape + (n,))
    return jax.lax.fori_loop(0, n - 1, up, (start, eye))[1]

  def depths_BN(self) -> jax.Array:
    """Depth of each node (root and padding: 0)."""
    return jnp.sum(self.ancestors_BNN(), axis=-1, dtype=jnp.int32) - 1

  def positions_BN(self, start_B) -> jax.Array:
    """Absolute (RoPE) positions: start + depth."""
    return start_B[:, None] + self.depths_BN()

  def slots_BN(self, start_B) -> jax.Array:
    """Cache slots the nodes' K/V are written to: start + node index."""
    return start_B[:, None] + jnp.arange(self.num_nodes, dtype=jnp.int32)[None, :]

  def attention_mask_BNS(self, start_B, cache_len: int) -> jax.Array:
    """[B, N, S] bool: node n sees cache slots < start and the slots of its ancestors and
    itself."""
    s = jnp.arange(cache_len, dtype=jnp.int32)[None, None, :]
    rel = s - start_B[:, None, None]
    anc = jnp.take_along_axis(self.ancestors_BNN(),
                              jnp.clip(rel, 0, self.num_nodes - 1), axis=-1)
    return (rel < 0) | ((rel < self.num_nodes) & anc)

  def children_BNK(self, max_children: Optional[int] = None) -> jax.Array:
    """[B, N, K] int32: node n's children in node order, -1 past the last; K defaults to
    N - 1 (children beyond K are dropped)."""
    b, n = self.tokens_BN.shape
    k = n - 1 if max_children is None else max_children
    parents = jnp.where(self.valid_BN(), self.parents_BN, -1)
    same = (parents[:, :, None] == parents[:, None, :]) & jnp.tri(n, k=-1, dtype=bool)
    rank_BN = jnp.sum(same, axis=-1)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, n))
    at_parent = jnp.where((parents >= 0) & (rank_BN < k), parents, n)   # n: dropped
    node = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    return jnp.full((b, n, max(k, 1)), -1, jnp.int32).at[rows, at_parent, rank_BN].set(
        node, mode='drop')[..., :k]

  def check(self) -> 'DraftTree':
    """Validates concrete (host-side) trees; ValueError naming the field."""
    if self.sibling_draw not in SIBLING_DRAWS:
      raise ValueError(f'sibling_draw must be one of {SIBLING_DRAWS}, got '
                       f'{self.sibling_draw!r}')
    if self.sibling_draw != 'deterministic' and self.q_BNV is None:
      raise ValueError(f'sibling_draw={self.sibling_draw!r} needs q_BNV')
    tokens, parents = np.asarray(self.tokens_BN), np.asarray(self.parents_BN)
    num_nodes = np.asarray(self.num_nodes_B)
    if tokens.ndim != 2 or parents.shape != tokens.shape:
      raise ValueError(f'tokens_BN and parents_BN must be [B, N] of one shape, got '
                       f'{tokens.shape} and {parents.shape}')
    if num_nodes.shape != tokens.shape[:1] or np.any(num_nodes < 1) or np.any(
        num_nodes > tokens.shape[1]):
      raise ValueError(f'num_nodes_B must be [B] in [1, {tokens.shape[1]}], got {num_nodes}')
    n = np.arange(tokens.shape[1])
    real = (n[None] >= 1) & (n[None] < num_nodes[:, None])
    if np.any(real & ((parents < 0) | (parents >= n[None]))):
      raise ValueError('parents_BN: every node 1 <= n < num_nodes needs 0 <= parent < n')
    if self.q_BNV is not None and np.shape(self.q_BNV)[:2] != tokens.shape:
      raise ValueError(f'q_BNV must be [B, N, V] with [B, N] = {tokens.shape}, got '
                       f'{np.shape(self.q_BNV)}')
    return self


def compact_path(cache: KVCache, start_B, path_BD1) -> KVCache:
  """Moves the K/V of the path's nodes (slots start + path[j]) to slots start + j in every
  layer; the caller sets the lengths (start + accepted + 1). Entries of the path past the
  accepted length land past the new length, where they are never attended."""
  b = path_BD1.shape[0]
  rows = jnp.arange(b)[:, None]
  src_BD1 = start_B[:, None] + path_BD1
  dst_BD1 = start_B[:, None] + jnp.arange(path_BD1.shape[1], dtype=jnp.int32)[None, :]
  src_BD1 = jnp.minimum(src_BD1, cache.max_len - 1)
  k = cache.k_LBSKD[:, rows, src_BD1]
  v = cache.v_LBSKD[:, rows, src_BD1]
  return cache.replace(k_LBSKD=cache.k_LBSKD.at[:, rows, dst_BD1].set(k, mode='drop'),
                       v_LBSKD=cache.v_LBSKD.at[:, rows, dst_BD1].set(v, mode='drop'))
