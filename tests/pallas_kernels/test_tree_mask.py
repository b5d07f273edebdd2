"""TreeMask, the block-attention kernels' tree verification mask.

The written definition (ancestor closure) against a hand matrix and `DraftTree`'s mask,
the interval view against the definition, and the Pallas kernels (interpret mode on CPU,
the platform kernel on hardware) forward and backward against the dense reference.
"""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspec.decoding.tree import DraftTree
from pallas_kernels.block_attention import api
from pallas_kernels.block_attention import masks
from test_block_attention import (Case, _hand_matrix, _inputs, _intervals_and_dense,
                                  _kernel_grads, _on_hardware, _reference_grads)


def _random_parents(rng, num_nodes, num_real, max_depth):
  """Parents of a random tree of `num_real` nodes with depth <= max_depth, padded to N."""
  parents, depth = [-1], [0]
  for _ in range(1, num_real):
    choices = [m for m in range(len(parents)) if depth[m] < max_depth]
    parent = int(rng.choice(choices))
    parents.append(parent)
    depth.append(depth[parent] + 1)
  return parents + [-1] * (num_nodes - num_real)


def _tree_offsets(context_lens, num_nodes, num_reals, max_depth, seed):
  rng = np.random.default_rng(seed)
  return tuple((c, *_random_parents(rng, num_nodes, r, max_depth))
               for c, r in zip(context_lens, num_reals))


CASES = {
    'tree': Case('tree', masks.TreeMask(24, 5), 24, 48,
                 _tree_offsets((13, 20), 24, (24, 17), 5, 0), 16, 16),
    'tree_gqa_deep': Case('tree_gqa_deep', masks.TreeMask(24, 9), 24, 48,
                          _tree_offsets((0, 7), 24, (20, 24), 9, 1), 16, 32, groups=2),
    'tree_chain': Case('tree_chain', masks.TreeMask(16, 15), 16, 40,
                       ((5, -1, *range(15)), (17, -1, *range(15))), 16, 16),
}


def test_hand_matrix():
  # root -> 1, 2; 1 -> 3; node 4 is padding; context_len 2.
  mask = masks.TreeMask(num_nodes=5, max_depth=2)
  np.testing.assert_array_equal(
      mask.dense(5, 8, [2, -1, 0, 0, 1, -1]),
      _hand_matrix(['11100000', '11110000', '11101000', '11110100', '11000010']))


@pytest.mark.slow
@pytest.mark.parametrize('name', list(CASES))
def test_definition_matches_draft_tree_and_intervals(name):
  case = CASES[name]
  bounds, dense = _intervals_and_dense(case.mask, case.q_len, case.kv_len, case.offsets)
  lo, hi = bounds[:, 0::2, :, None], bounds[:, 1::2, :, None]
  kv_idx = np.arange(case.kv_len)
  np.testing.assert_array_equal(((kv_idx >= lo) & (kv_idx < hi)).any(1), dense)
  offsets = np.asarray(case.offsets)
  parents = offsets[:, 1:]
  num_real = np.asarray([1 + np.max(np.nonzero(p >= 0)[0], initial=0) for p in parents])
  tree = DraftTree(jnp.zeros_like(parents), jnp.asarray(parents), jnp.asarray(num_real))
  np.testing.assert_array_equal(
      tree.attention_mask_BNS(jnp.asarray(offsets[:, 0]), case.kv_len), dense)
  assert int(tree.depths_BN().max()) <= case.mask.max_depth


@pytest.mark.slow
@pytest.mark.parametrize('name', list(CASES))
def test_kernel_forward_and_grads_match_reference(name):
  case = CASES[name]
  q, k, v, cotangent, offsets = _inputs(case, seed=len(name))
  implementation = None if _on_hardware() else 'interpret'
  got = _kernel_grads(case.mask, implementation, case.block_q, case.block_kv,
                      not _on_hardware(), q, k, v, cotangent, offsets)
  want = _reference_grads(case.mask, q, k, v, cotangent, offsets)
  tol = 2e-4 if _on_hardware() else 2e-5
  for label, g, w in zip(('out', 'dq', 'dk', 'dv'), got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=tol, rtol=tol,
                               err_msg=label)


def test_bad_offsets_raise():
  mask = masks.TreeMask(4, 2)
  with pytest.raises(ValueError, match='offsets'):
    mask.prepare_offsets(jnp.zeros((2, 4), jnp.int32), 2, 4)
  with pytest.raises(ValueError, match='Q = N'):
    mask.resolve(5, 9)
  with pytest.raises(ValueError, match='max_depth'):
    masks.TreeMask(4, 4)



@pytest.mark.parametrize('platform', ['cuda', 'tpu'])
def test_kernels_lower_for_gpu_and_tpu(platform):
  """The forward, dq and dk/dv kernels of the tree mask lower to Triton / Mosaic."""
  case = CASES['tree_gqa_deep']
  implementation = 'pallas_gpu' if platform == 'cuda' else 'pallas_tpu'
  tiles = (64, 64) if platform == 'cuda' else (128, 128)
  q, k, v, cotangent, offsets = _inputs(case, seed=0)

  def fwd_bwd(q, k, v, cotangent, offsets):
    out, vjp = jax.vjp(lambda q, k, v: api.block_attention(
        q, k, v, case.mask, offsets, implementation=implementation, block_q=tiles[0],
        block_kv=tiles[1]), q, k, v)
    return (out,) + vjp(cotangent)

  as_bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v, cotangent)]
  with mock.patch.object(api, '_platform',
                         return_value='gpu' if platform == 'cuda' else 'tpu'):
    text = jax.jit(fwd_bwd).trace(*as_bf16, offsets).lower(
        lowering_platforms=(platform,)).as_text()
  kernel_call = '__gpu$xla.gpu.triton' if platform == 'cuda' else '@tpu_custom_call'
  assert text.count(kernel_call) == 3
