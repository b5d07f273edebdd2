"""DraftTree structure (ancestors, depths, mask, children, KV compaction) and greedy tree
verification on hand-built trees; a chain tree verifies like `verification.py`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspec.decoding.tree import DraftTree, compact_path
from dspec.decoding.tree_verification import greedy_tree_verify, rejection_tree_verify
from dspec.decoding.verification import greedy_verify
from dspec.models.kv_cache import KVCache

# root(9) -> 1(1), 2(2); 1 -> 3(3), 4(3: duplicate of 3); 3 -> 5(4); node 6 is padding.
HAND = DraftTree(tokens_BN=jnp.asarray([[9, 1, 2, 3, 3, 4, 0]]),
                 parents_BN=jnp.asarray([[-1, 0, 0, 1, 1, 3, -1]]),
                 num_nodes_B=jnp.asarray([6]))


def _logits_with_argmax(argmax_N, vocab=10):
  return jax.nn.one_hot(jnp.asarray(argmax_N)[None], vocab) * 5.0


@pytest.mark.slow
def test_structure_of_a_hand_tree():
  HAND.check()
  np.testing.assert_array_equal(HAND.depths_BN()[0], [0, 1, 1, 2, 2, 3, 0])
  np.testing.assert_array_equal(HAND.positions_BN(jnp.asarray([7]))[0],
                                [7, 8, 8, 9, 9, 10, 7])
  np.testing.assert_array_equal(HAND.children_BNK()[0, :, :2],
                                [[1, 2], [3, 4], [-1, -1], [5, -1], [-1, -1], [-1, -1],
                                 [-1, -1]])
  mask = np.asarray(HAND.attention_mask_BNS(jnp.asarray([2]), 10)[0]).astype(int)
  np.testing.assert_array_equal(mask, [[1, 1, 1, 0, 0, 0, 0, 0, 0, 0],
                                       [1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
                                       [1, 1, 1, 0, 1, 0, 0, 0, 0, 0],
                                       [1, 1, 1, 1, 0, 1, 0, 0, 0, 0],
                                       [1, 1, 1, 1, 0, 0, 1, 0, 0, 0],
                                       [1, 1, 1, 1, 0, 1, 0, 1, 0, 0],
                                       [1, 1, 0, 0, 0, 0, 0, 0, 1, 0]])


@pytest.mark.slow
def test_greedy_takes_the_deepest_matching_path():
  # argmax at root 1 (node 1), at node 1: 3 (nodes 3 and 4), at node 3: 4 (node 5).
  n, path, out = greedy_tree_verify(HAND, _logits_with_argmax([1, 3, 0, 4, 7, 8, 0]), 6)
  assert int(n[0]) == 3
  np.testing.assert_array_equal(path[0, :4], [0, 1, 3, 5])
  np.testing.assert_array_equal(out[0, :4], [1, 3, 4, 8])
  # The duplicate sibling's subtree is used when only it continues; depth cap at 1.
  n, path, out = greedy_tree_verify(HAND, _logits_with_argmax([1, 3, 0, 6, 7, 8, 0]), 6)
  np.testing.assert_array_equal(path[0, :3], [0, 1, 3])
  np.testing.assert_array_equal(out[0, :3], [1, 3, 6])
  n, path, out = greedy_tree_verify(HAND, _logits_with_argmax([1, 3, 0, 4, 7, 8, 0]), 1)
  np.testing.assert_array_equal(out[0], [1, 3])
  # A padding node whose token matches is never accepted.
  n, _, out = greedy_tree_verify(HAND, _logits_with_argmax([0, 3, 0, 4, 7, 8, 0]), 6)
  assert int(n[0]) == 0 and int(out[0, 0]) == 0


@pytest.mark.slow
@pytest.mark.parametrize('greedy', [True, False])
def test_chain_tree_verifies_like_the_chain(greedy):
  key = jax.random.key(1)
  b, g, v = 6, 5, 8
  logits = jax.random.normal(key, (b, g + 1, v)) * 3
  argmax = jnp.argmax(logits, -1)
  drafts = jnp.where(jax.random.uniform(key, (b, g)) < 0.8, argmax[:, :g], (argmax[:, :g] + 1) % v)
  num = jnp.asarray([5, 3, 0, 2, 5, 4])
  chain = DraftTree.chain(jnp.zeros((b,), jnp.int32), drafts, num).check()
  want_n, want_out = greedy_verify(drafts, num, logits)
  if greedy:
    n, path, out = greedy_tree_verify(chain, logits, g)
  else:   # a near-one-hot target accepts exactly the argmax matches
    n, path, out = rejection_tree_verify(key, chain, jax.nn.softmax(logits * 1e3), lambda x: x,
                                         g)
  np.testing.assert_array_equal(n, want_n)
  for row in range(b):
    np.testing.assert_array_equal(out[row, :n[row] + 1], want_out[row, :n[row] + 1])
    np.testing.assert_array_equal(path[row, :n[row] + 1], np.arange(n[row] + 1))


def test_compact_path_moves_the_accepted_nodes():
  cache = KVCache.zeros(2, 1, 12, 1, 1)
  values = jnp.arange(12, dtype=jnp.float32)[None, None, :, None, None] * jnp.ones((2, 1, 1, 1, 1))
  cache = cache.replace(k_LBSKD=values, v_LBSKD=-values)
  moved = compact_path(cache, jnp.asarray([3]), jnp.asarray([[0, 2, 5, 0]]))
  np.testing.assert_array_equal(moved.k_LBSKD[1, 0, :, 0, 0],
                                [0, 1, 2, 3, 5, 8, 3, 7, 8, 9, 10, 11])
  np.testing.assert_array_equal(moved.v_LBSKD[0, 0, :, 0, 0],
                                -np.asarray([0, 1, 2, 3, 5, 8, 3, 7, 8, 9, 10, 11]))


@pytest.mark.parametrize('fields, match', [
    (dict(parents_BN=jnp.asarray([[-1, 0, 2, 1, 1, 3, -1]])), 'parents_BN'),
    (dict(num_nodes_B=jnp.asarray([8])), 'num_nodes_B'),
    (dict(sibling_draw='sampled'), 'sibling_draw'),
    (dict(sibling_draw='with_replacement'), 'q_BNV'),
])
def test_check_names_the_bad_field(fields, match):
  with pytest.raises(ValueError, match=match):
    HAND.replace(**fields).check()
