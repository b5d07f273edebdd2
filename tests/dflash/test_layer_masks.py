"""Per-layer DFlash masks (`dspec.models.dflash_masks`): z-lab's rule, the interval view the
kernels use, dspec's anchor-relative masks as a special case, and the Pallas kernel (in
interpret mode) against the dense reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from dflash import model as zlab

from dspec.models.dflash_masks import DraftLayerMask, TrainLayerMask
from pallas_kernels.block_attention import (DFlashDraftMask, DFlashTrainMask,
                                            block_attention, reference_attention)
from pallas_kernels.block_attention import mask_info
from pallas_kernels.block_attention.reference import dense_mask

CACHE, BLOCK, CONTEXT = 24, 8, 20
ANCHORS = ((3, 11, -1), (0, 7, 12))
DRAFT = [DraftLayerMask(BLOCK), DraftLayerMask(BLOCK, causal=True),
         DraftLayerMask(BLOCK, window=3), DraftLayerMask(BLOCK, causal=True, window=5),
         DraftLayerMask(BLOCK, anchor_window=4), DraftLayerMask(BLOCK, window=20)]
TRAIN = [TrainLayerMask(4, CONTEXT), TrainLayerMask(4, CONTEXT, causal=True, window=3),
         TrainLayerMask(4, CONTEXT, window=2), TrainLayerMask(4, CONTEXT, anchor_window=5)]


def _dense(mask, q_len, kv_len, offsets):
  return np.asarray(dense_mask(mask, jnp.asarray(offsets), len(offsets), q_len, kv_len))


def _from_intervals(mask, q_len, kv_len, offsets):
  mask = mask.resolve(q_len, kv_len)
  bounds = np.asarray(mask_info.row_bounds(
      mask, mask.prepare_offsets(jnp.asarray(offsets), len(offsets), q_len), q_len, kv_len,
      q_len))
  lo, hi = bounds[:, 0::2, :, None], bounds[:, 1::2, :, None]
  kv = np.arange(kv_len)
  return ((kv >= lo) & (kv < hi)).any(1)


@pytest.mark.slow
@pytest.mark.parametrize('mask', DRAFT + TRAIN, ids=str)
def test_intervals_match_definition(mask):
  if isinstance(mask, DraftLayerMask):
    shape, offsets = (BLOCK, CACHE + BLOCK), ((13, 8), (9, 3))
  else:
    shape, offsets = (12, CONTEXT + 12), ANCHORS
  np.testing.assert_array_equal(_from_intervals(mask, *shape, offsets),
                                _dense(mask, *shape, offsets))


@pytest.mark.slow
@pytest.mark.parametrize('mask', DRAFT[:4] + DRAFT[5:], ids=str)
@pytest.mark.parametrize('anchor,block_len', [(13, 8), (6, 3)])
def test_draft_mask_is_zlabs(mask, anchor, block_len):
  """With every context position cached (keys = positions 0..anchor+block_len−1), the
  visible set equals z-lab's `_attention_mask` (no mask = all visible)."""
  ours = _dense(mask, BLOCK, CACHE + BLOCK, ((anchor, block_len),))[0]
  keys = np.r_[np.arange(anchor), CACHE + np.arange(block_len)]
  got = ours[:block_len][:, keys]
  if mask.causal or mask.window is not None:
    q = torch.zeros(1, 1, block_len, 1)
    k = torch.zeros(1, 1, anchor + block_len, 1)
    want = zlab._attention_mask(q, k, is_causal=mask.causal,
                                sliding_window=mask.window)[0, 0].numpy()
  else:
    want = np.ones_like(got)
  np.testing.assert_array_equal(got, want)


def test_anchor_window_is_dspecs_own_masks():
  draft_offsets = ((13, BLOCK), (9, BLOCK))
  np.testing.assert_array_equal(
      _dense(DraftLayerMask(BLOCK, anchor_window=4), BLOCK, CACHE + BLOCK, draft_offsets),
      _dense(DFlashDraftMask(BLOCK, window=4), BLOCK, CACHE + BLOCK, (13, 9)))
  np.testing.assert_array_equal(
      _dense(TrainLayerMask(4, CONTEXT, anchor_window=5), 12, CONTEXT + 12, ANCHORS),
      _dense(DFlashTrainMask(4, CONTEXT, window=5), 12, CONTEXT + 12, ANCHORS))


@pytest.mark.slow
@pytest.mark.parametrize('mask,shape,offsets', [
    (DraftLayerMask(BLOCK, causal=True, window=5), (BLOCK, CACHE + BLOCK), ((13, 6), (4, 8))),
    (TrainLayerMask(4, CONTEXT, causal=True, window=3), (12, CONTEXT + 12), ANCHORS),
], ids=['draft', 'train'])
def test_pallas_interpret_matches_reference(mask, shape, offsets):
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (2, shape[0], 4, 16))
  k = jax.random.normal(keys[1], (2, shape[1], 2, 16))
  v = jax.random.normal(keys[2], (2, shape[1], 2, 16))
  offsets = jnp.asarray(offsets)
  got = block_attention(q, k, v, mask, offsets, implementation='interpret', block_q=16,
                        block_kv=16)
  np.testing.assert_allclose(np.asarray(got),
                             np.asarray(reference_attention(q, k, v, mask, offsets)),
                             atol=2e-5)
