"""Tests for pallas_kernels.block_attention.

``BlockAttentionTest`` runs the platform's Pallas kernel on real hardware (GPU or
TPU) and is skipped on CPU; ``BlockAttentionInterpretTest`` runs the same tests
with the kernels in interpret mode on CPU. Shapes are small and every jitted
function is compiled once per case.
"""

from __future__ import annotations

import dataclasses
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized

from pallas_kernels.block_attention import api
from pallas_kernels.block_attention import kernel_gpu
from pallas_kernels.block_attention import mask_info
from pallas_kernels.block_attention import masks
from pallas_kernels.block_attention import reference


@dataclasses.dataclass(frozen=True)
class Case:
  """One attention problem: mask, shapes, offsets, tiles, GQA ratio."""

  name: str
  mask: masks.AttentionMask
  q_len: int
  kv_len: int
  offsets: tuple | None
  block_q: int
  block_kv: int
  groups: int = 1
  dtype: str = 'float32'
  kernel: str = 'gpu'  # which kernel family: 'gpu' (also interpret) or 'tpu'


def _case_list():
  train = masks.DFlashTrainMask(block_size=4, context_len=20)
  anchors = ((3, 11, -1, 20), (0, 8, 19, 5))  # includes an invalid block
  return [
      Case('causal', masks.CausalMask(), 24, 40, (16, 3), 16, 16),
      Case('causal_window_gqa', masks.CausalMask(window=7), 24, 40, (16, 0),
           16, 32, groups=2),
      Case('dflash_train_gqa', train, 16, 36, anchors, 16, 16, groups=2),
      Case('dflash_train_window', masks.DFlashTrainMask(4, 20, window=6), 16,
           36, anchors, 16, 32),
      Case('dflash_draft_gqa', masks.DFlashDraftMask(block_size=8), 8, 48,
           (13, 40), 16, 16, groups=2),
      Case('dflash_draft_window', masks.DFlashDraftMask(8, window=5), 8, 48,
           (13, 3), 16, 32),
      Case('bd3lm', masks.BD3LMMask(block_size=4, seq_len=16), 32, 32, None,
           16, 16),
      Case('bd3lm_gqa', masks.BD3LMMask(block_size=8, seq_len=24), 48, 48,
           None, 16, 32, groups=2),
      Case('dflash_train_bf16', train, 16, 36, anchors, 16, 16,
           dtype='bfloat16'),
      Case('tpu_dflash_train_gqa', masks.DFlashTrainMask(32, 200), 256, 456,
           ((40, 131, -1, 199, 0, 7, 200, 64), (3, 190, 66, 2, -1, 100, 1, 9)),
           128, 128, groups=2, kernel='tpu'),
  ]


CASES = {case.name: case for case in _case_list()}
_NUM_KV_HEADS = 2
_HEAD_DIM = 16


def _inputs(case: Case, seed: int):
  """Fresh random q, k, v, output cotangent (never zeros) and offsets."""
  rng = np.random.default_rng(seed)
  num_heads = _NUM_KV_HEADS * case.groups
  q_shape = (2, case.q_len, num_heads, _HEAD_DIM)
  kv_shape = (2, case.kv_len, _NUM_KV_HEADS, _HEAD_DIM)
  q, k, v = (jnp.asarray(rng.standard_normal(shape), case.dtype)
             for shape in (q_shape, kv_shape, kv_shape))
  cotangent = jnp.asarray(rng.standard_normal(q_shape), jnp.float32)
  offsets = None if case.offsets is None else jnp.asarray(case.offsets,
                                                           jnp.int32)
  return q, k, v, cotangent, offsets


def _value_and_grads(attention, q, k, v, cotangent, offsets):
  out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, offsets), q, k, v)
  return (out,) + vjp(cotangent.astype(out.dtype))


@functools.partial(jax.jit, static_argnums=0)
def _reference_grads(mask, q, k, v, cotangent, offsets):
  def attention(q, k, v, offsets):
    return reference.reference_attention(q, k, v, mask, offsets)

  return _value_and_grads(attention, q, k, v, cotangent, offsets)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _kernel_grads(mask, implementation, block_q, block_kv, interpret, q, k, v,
                  cotangent, offsets):
  def attention(q, k, v, offsets):
    return api.block_attention(q, k, v, mask, offsets,
                               implementation=implementation, block_q=block_q,
                               block_kv=block_kv, interpret=interpret)

  return _value_and_grads(attention, q, k, v, cotangent, offsets)


def _run_kernel(case: Case, interpret: bool, *args):
  if case.kernel == 'tpu':
    implementation = 'pallas_tpu'
  else:
    implementation = 'interpret' if interpret else None
  return _kernel_grads(case.mask, implementation, case.block_q, case.block_kv,
                       interpret, *args)


def _on_hardware() -> bool:
  return jax.default_backend() in ('gpu', 'cuda', 'rocm', 'tpu')


def _platform_kernel() -> str:
  return 'tpu' if jax.default_backend() == 'tpu' else 'gpu'


class BlockAttentionTest(parameterized.TestCase):
  """Kernel vs reference on real hardware (skipped on CPU)."""

  INTERPRET = False

  def setUp(self):
    super().setUp()
    if self.INTERPRET == _on_hardware():
      self.skipTest('interpret tests run on CPU, hardware tests on GPU/TPU')

  def _skip_other_platform(self, kernel: str):
    if not self.INTERPRET and kernel != _platform_kernel():
      self.skipTest(f'the {kernel} kernel needs its own platform')

  @parameterized.named_parameters((name, name) for name in CASES)
  @pytest.mark.slow   # under the parameterisation: absl copies it to each generated test
  def test_forward_and_grads_match_reference(self, name):
    case = CASES[name]
    self._skip_other_platform(case.kernel)
    q, k, v, cotangent, offsets = _inputs(case, seed=len(name))
    got = _run_kernel(case, self.INTERPRET, q, k, v, cotangent, offsets)
    upcast = [x.astype(jnp.float32) for x in (q, k, v)]
    want = _reference_grads(case.mask, *upcast, cotangent, offsets)
    if case.dtype == 'bfloat16':
      tol = 6e-2
    else:
      tol = 2e-5 if self.INTERPRET else 2e-4
    for label, g, w in zip(('out', 'dq', 'dk', 'dv'), got, want):
      assert g.dtype == q.dtype, label
      np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w),
                                 atol=tol, rtol=tol, err_msg=label)

  @pytest.mark.slow
  def test_fully_masked_rows_are_zero(self):
    case = CASES['dflash_train_gqa']  # batch 0, block 2 has anchor -1
    q, k, v, cotangent, offsets = _inputs(case, seed=7)
    out, dq, _, _ = _run_kernel(case, self.INTERPRET, q, k, v, cotangent,
                                offsets)
    rows = slice(8, 12)
    assert np.all(np.asarray(out[0, rows]) == 0.0)
    assert np.all(np.asarray(dq[0, rows]) == 0.0)
    assert np.all(np.isfinite(np.asarray(dq)))

  @pytest.mark.slow
  def test_kernel_skips_empty_tiles(self):
    """The forward loop visits exactly the non-empty tiles, fewer than all."""
    self._skip_other_platform('gpu')
    mask = masks.DFlashTrainMask(block_size=16, context_len=64)
    anchors = jnp.asarray([[5, 60, -1, 17, 33, 64, 1, 40],
                           [64, 0, 12, 50, 9, -1, 30, 2]], jnp.int32)
    block, q_len, kv_len = 16, 128, 192
    q, k, v, _, _ = _inputs(
        Case('skip', mask, q_len, kv_len, None, block, block), seed=3)
    info = jax.jit(mask_info.build_block_info, static_argnums=(0, 2, 3, 4, 5))(
        mask, anchors, q_len, kv_len, block, block)
    # The static list width (max_kv_tiles) is shorter than the kv grid.
    width = info.fwd.entries.shape[-1]
    self.assertLess(width, kv_len // block)
    self.assertLessEqual(int(info.fwd.count.max()), width)
    out, _, visits = jax.jit(functools.partial(
        kernel_gpu.forward, scale=0.25, block_q=block, block_kv=block,
        interpret=self.INTERPRET, count_visits=True))(q, k, v, info)
    want = jax.jit(reference.reference_attention, static_argnums=3)(
        q, k, v, mask, anchors, 0.25)
    np.testing.assert_allclose(out, want, atol=2e-4, rtol=2e-4)
    for b in range(2):
      dense = mask.dense(q_len, kv_len, anchors[b])
      tiles = dense.reshape(q_len // block, block, kv_len // block, block)
      nonempty = tiles.any(axis=(1, 3)).sum(axis=1)
      np.testing.assert_array_equal(
          np.asarray(visits[b]), np.broadcast_to(nonempty, visits.shape[1:]))
    total_tiles = visits.size * (kv_len // block)
    self.assertLess(int(visits.sum()), total_tiles // 2)


class BlockAttentionInterpretTest(BlockAttentionTest):
  INTERPRET = True


class BlockedTrainAttentionTest(parameterized.TestCase):
  """The XLA backend's per-block form of the DFlash training mask equals the dense one."""

  @parameterized.named_parameters(
      ('gqa', 'dflash_train_gqa'), ('window', 'dflash_train_window'))
  @pytest.mark.slow
  def test_forward_and_grads_match_dense_reference(self, name):
    case = CASES[name]
    q, k, v, cotangent, offsets = _inputs(case, seed=11)
    with mock.patch.object(api, 'reference_attention',
                           side_effect=AssertionError('dense path taken')):
      got = _kernel_grads(case.mask, 'xla', None, None, False, q, k, v, cotangent,
                          offsets)
    want = _reference_grads(case.mask, q, k, v, cotangent, offsets)
    for label, g, w in zip(('out', 'dq', 'dk', 'dv'), got, want):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=2e-5,
                                 err_msg=label)
    rows = slice(8, 12)   # batch 0, block 2: anchor -1 sees nothing
    assert np.all(np.asarray(got[0][0, rows]) == 0.0)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _intervals_and_dense_jit(mask, q_len, kv_len, offsets):
  mask = mask.resolve(q_len, kv_len)
  offsets_B = mask.prepare_offsets(offsets and jnp.asarray(offsets), 2, q_len)
  bounds = mask_info.row_bounds(mask, offsets_B, q_len, kv_len, q_len)
  return bounds, reference.dense_mask(mask, offsets_B if offsets else None, 2,
                                      q_len, kv_len)


def _intervals_and_dense(mask, q_len, kv_len, offsets):
  return jax.tree.map(np.asarray,
                      _intervals_and_dense_jit(mask, q_len, kv_len, offsets))


class CrossPlatformLoweringTest(parameterized.TestCase):
  """Lowers the GPU (Triton) and TPU (Mosaic) kernels from any host.

  Lowering runs the Pallas -> Triton / Mosaic translation, so unsupported ops or
  block shapes fail here even without the hardware.
  """

  @parameterized.product(
      platform=('cuda', 'tpu'),
      name=('causal_window_gqa', 'dflash_train_gqa', 'dflash_draft_gqa',
            'bd3lm_gqa'))
  def test_fwd_and_bwd_lower(self, platform, name):
    case = CASES[name]
    implementation = 'pallas_gpu' if platform == 'cuda' else 'pallas_tpu'
    tiles = (64, 64) if platform == 'cuda' else (128, 128)
    q, k, v, cotangent, offsets = _inputs(case, seed=0)

    def fwd_bwd(q, k, v, cotangent, offsets):
      out, vjp = jax.vjp(lambda q, k, v: api.block_attention(
          q, k, v, case.mask, offsets, implementation=implementation,
          block_q=tiles[0], block_kv=tiles[1]), q, k, v)
      return (out,) + vjp(cotangent)

    as_bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v, cotangent)]
    with mock.patch.object(api, '_platform',
                           return_value='gpu' if platform == 'cuda' else 'tpu'):
      text = jax.jit(fwd_bwd).trace(*as_bf16, offsets).lower(
          lowering_platforms=(platform,)).as_text()
    kernel_call = ('__gpu$xla.gpu.triton' if platform == 'cuda'
                   else '@tpu_custom_call')
    self.assertEqual(text.count(kernel_call), 3)  # forward, dq, dk/dv


def _hand_matrix(rows: list[str]) -> np.ndarray:
  return np.array([[c == '1' for c in row] for row in rows])


class MaskDefinitionTest(parameterized.TestCase):
  """Each mask against its written definition, on hand-written matrices."""

  def test_dflash_train(self):
    mask = masks.DFlashTrainMask(block_size=2, context_len=3)
    np.testing.assert_array_equal(
        mask.dense(4, 7, [1, 3]),
        _hand_matrix(['1001100', '1001100', '1110011', '1110011']))
    np.testing.assert_array_equal(
        mask.dense(4, 7, [1, -1]),
        _hand_matrix(['1001100', '1001100', '0000000', '0000000']))
    windowed = masks.DFlashTrainMask(block_size=2, context_len=3, window=2)
    np.testing.assert_array_equal(
        windowed.dense(4, 7, [1, 3]),
        _hand_matrix(['1001100', '1001100', '0010011', '0010011']))

  def test_bd3lm(self):
    mask = masks.BD3LMMask(block_size=2, seq_len=4)
    np.testing.assert_array_equal(
        mask.dense(8, 8),
        _hand_matrix(['11000000', '11000000', '00111100', '00111100',
                      '00001100', '00001100', '00001111', '00001111']))

  def test_causal(self):
    np.testing.assert_array_equal(
        masks.CausalMask().dense(3, 4),
        _hand_matrix(['1000', '1100', '1110']))
    np.testing.assert_array_equal(
        masks.CausalMask(window=2).dense(3, 5, 2),
        _hand_matrix(['01100', '00110', '00011']))

  def test_dflash_draft(self):
    mask = masks.DFlashDraftMask(block_size=2)
    np.testing.assert_array_equal(mask.dense(2, 5, 2),
                                  _hand_matrix(['11011', '11011']))
    np.testing.assert_array_equal(
        masks.DFlashDraftMask(block_size=2, window=2).dense(2, 5, 2),
        _hand_matrix(['01011', '01011']))

  @parameterized.named_parameters(
      (name, name) for name in CASES if 'bf16' not in name)
  def test_intervals_match_definition(self, name):
    """The kernels' interval view equals the written definition."""
    case = CASES[name]
    bounds, dense = _intervals_and_dense(case.mask, case.q_len, case.kv_len,
                                         case.offsets)
    lo, hi = bounds[:, 0::2, :, None], bounds[:, 1::2, :, None]
    kv_idx = np.arange(case.kv_len)
    np.testing.assert_array_equal(((kv_idx >= lo) & (kv_idx < hi)).any(1),
                                  dense)

  def test_masks_are_static_and_hashable(self):
    assert hash(masks.DFlashTrainMask(16, 3072)) == hash(
        masks.DFlashTrainMask(16, 3072))
    with self.assertRaises(dataclasses.FrozenInstanceError):
      masks.CausalMask().window = 3  # pytype: disable=not-writable
    with self.assertRaises(ValueError):
      masks.DFlashTrainMask(4, 8).resolve(q_len=8, kv_len=17)


class MaskInfoTest(absltest.TestCase):

  def test_tile_classes_match_dense_mask(self):
    mask = masks.DFlashTrainMask(block_size=4, context_len=20)
    anchors = jnp.asarray([[3, 11, -1, 20], [0, 8, 19, 5]], jnp.int32)
    classes_fn = jax.jit(lambda a: mask_info.tile_classes(
        mask_info.row_bounds(mask, a, 16, 36, 16), 16, 36, 4, 8))
    info_classes = classes_fn(anchors)
    for b in range(2):
      dense = np.zeros((16, 40), bool)
      dense[:, :36] = mask.dense(16, 36, anchors[b])
      tiles = dense.reshape(4, 4, 5, 8)
      want = np.where(tiles.all(axis=(1, 3)), 2,
                      np.where(tiles.any(axis=(1, 3)), 1, 0))
      np.testing.assert_array_equal(np.asarray(info_classes[b]), want)

  def test_compact_lists_nonempty_tiles_in_order(self):
    classes = jnp.asarray([[[0, 2, 0, 1], [0, 0, 0, 0], [1, 1, 2, 0]]])
    tiles = mask_info.compact(classes)
    np.testing.assert_array_equal(tiles.count, [[2, 0, 3]])
    # 2 * index + is_full, padded by repeating the last real entry.
    np.testing.assert_array_equal(
        tiles.entries, [[[3, 6, 6, 6], [0, 0, 0, 0], [0, 2, 5, 5]]])


class ApiTest(absltest.TestCase):

  def test_fallback_warns_once(self):
    if jax.default_backend() != 'cpu':
      self.skipTest('fallback is exercised on CPU')
    case = CASES['causal']
    q, k, v, _, offsets = _inputs(case, seed=1)
    api._warned.clear()
    with mock.patch.object(api.logging, 'warning') as warning, \
        mock.patch.object(api, 'reference_attention',
                          wraps=reference.reference_attention) as fallback:
      for _ in range(2):
        out = jax.eval_shape(functools.partial(
            api.block_attention, mask=case.mask, offsets=offsets,
            implementation='pallas_gpu'), q, k, v)
    self.assertEqual(warning.call_count, 1)
    self.assertEqual(fallback.call_count, 2)
    self.assertEqual(out.shape, q.shape)

  def test_default_implementation_on_cpu_is_xla(self):
    if jax.default_backend() != 'cpu':
      self.skipTest('CPU only')
    case = CASES['bd3lm']
    q, k, v, _, _ = _inputs(case, seed=2)
    with mock.patch.object(api, 'reference_attention',
                           wraps=reference.reference_attention) as xla:
      jax.eval_shape(functools.partial(api.block_attention, mask=case.mask),
                     q, k, v)
    self.assertEqual(xla.call_count, 1)

  def test_bad_arguments_raise(self):
    case = CASES['causal']
    q, k, v, _, offsets = _inputs(case, seed=1)
    with self.assertRaises(ValueError):
      api.block_attention(q, k, v, case.mask, implementation='cuda')
    with self.assertRaises(ValueError):
      api.block_attention(q, k[:, :, :1].repeat(3, axis=2),
                          v[:, :, :1].repeat(3, axis=2), case.mask)
    with self.assertRaises(ValueError):
      api.block_attention(q, k, v, masks.DFlashDraftMask(8), None)


if __name__ == '__main__':
  absltest.main()
