"""Pallas Mosaic TPU block-sparse flash attention (forward, dq, dk/dv).

Written for real TPUs in the style of splash attention; on CPU it runs with
``interpret=True`` (tests). Layout inside: q/o ``[batch, H, T, D]``, k/v
``[batch, K, S, D]`` (the wrappers transpose from ``[batch, T, H, D]``).
Tiles: ``block_kv`` and ``D`` are multiples of 128; ``block_q`` is a multiple of
128 or the whole (padded) query length.

Sparsity (see ``mask_info``): the tile lists and counts are scalar-prefetched
into SMEM (``PrefetchScalarGridSpec``). The innermost grid axis walks the
compacted list; the k/v (or q, in dk/dv) ``index_map`` reads the tile index from
the list, and list padding repeats the last real entry, so steps past ``count``
issue no new DMA and their compute is skipped by ``pl.when(t < count)``. Full
tiles skip the mask. Row statistics (m, l, logsumexp) are kept lane-replicated
``[bq, 128]`` as in splash attention. For GQA the dk/dv grid visits the query
heads of a group consecutively and accumulates into one kv-head output.

Tuning notes (untested on hardware): every grid step costs ~0.35 us even when
skipped, so larger tiles (e.g. 256-512) may pay off on TPU despite coarser
sparsity; the tile lists live in SMEM (1 MiB on v4+), about
``batch * (num_q_tiles * max_kv_tiles + num_kv_tiles * num_q_tiles)`` int32.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from pallas_kernels.block_attention import mask_info as mask_info_lib
from pallas_kernels.block_attention.reference import MASK_VALUE

NUM_LANES = 128
NUM_SUBLANES = 8
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b


def _dot(a, b, dims) -> jax.Array:
  exact = a.dtype == jnp.float32 and b.dtype == jnp.float32
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32,
                         precision=lax.Precision.HIGHEST if exact else None)


def _lanes(x, width: int) -> jax.Array:
  """Lane-replicated ``[rows, 128]`` -> ``[rows, width]`` (width % 128 == 0)."""
  return jnp.tile(x, (1, width // NUM_LANES))


def _visible(bounds_ref, start, block_q: int, block_kv: int,
             num_intervals: int) -> jax.Array:
  """[bq, bk] mask of a kv tile starting at ``start`` (rows layout bounds)."""
  kv_idx = start + lax.broadcasted_iota(jnp.int32, (block_q, block_kv), 1)
  bounds = [_lanes(bounds_ref[n], block_kv) for n in range(2 * num_intervals)]
  return mask_info_lib.in_intervals(kv_idx, bounds)


def _unpack(entry, tile: int):
  return lax.div(entry, 2) * tile, lax.rem(entry, 2) == 1


def _when_full_or_partial(is_full, compute) -> None:
  """Runs ``compute(masked=False)`` on full tiles, ``compute(True)`` otherwise."""
  pl.when(is_full)(lambda: compute(False))
  pl.when(jnp.logical_not(is_full))(lambda: compute(True))


def _fwd_kernel(entries_ref, count_ref, bounds_ref, q_ref, k_ref, v_ref,
                o_ref, lse_ref, m_scr, l_scr, acc_scr, *, scale, num_q_tiles,
                max_tiles, num_intervals):
  b, i, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  row = b * num_q_tiles + i
  block_q, block_kv = q_ref.shape[0], k_ref.shape[0]
  head_dim = acc_scr.shape[-1]

  @pl.when(t == 0)
  def _init():
    m_scr[...] = jnp.full_like(m_scr, MASK_VALUE)
    l_scr[...] = jnp.zeros_like(l_scr)
    acc_scr[...] = jnp.zeros_like(acc_scr)

  start, is_full = _unpack(entries_ref[row * max_tiles + t], block_kv)

  def compute(masked: bool):
    logits = _dot(q_ref[...], k_ref[...], _NT) * scale
    if masked:
      visible = _visible(bounds_ref, start, block_q, block_kv, num_intervals)
      logits = jnp.where(visible, logits, MASK_VALUE)
    m_prev, l_prev = m_scr[...], l_scr[...]
    m_next = jnp.maximum(m_prev, logits.max(axis=-1, keepdims=True))
    p = jnp.exp(logits - _lanes(m_next, block_kv))
    if masked:
      p = jnp.where(visible, p, 0.0)
    alpha = jnp.exp(m_prev - m_next)
    m_scr[...] = m_next
    l_scr[...] = alpha * l_prev + p.sum(axis=-1, keepdims=True)
    v = v_ref[...]
    acc_scr[...] = (_lanes(alpha, head_dim) * acc_scr[...]
                    + _dot(p.astype(v.dtype), v, _NN))

  pl.when(t < count_ref[row])(
      lambda: _when_full_or_partial(is_full, compute))

  @pl.when(t == max_tiles - 1)
  def _finalize():
    l = l_scr[...]
    empty = l == 0.0
    inv = _lanes(1.0 / jnp.where(empty, 1.0, l), head_dim)
    o_ref[...] = (acc_scr[...] * inv).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.inf, m_scr[...] + jnp.log(l))


def _dq_kernel(entries_ref, count_ref, bounds_ref, q_ref, k_ref, v_ref,
               do_ref, lse_ref, delta_ref, dq_ref, dq_scr, *, scale,
               num_q_tiles, max_tiles, num_intervals):
  b, i, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  row = b * num_q_tiles + i
  block_q, block_kv = q_ref.shape[0], k_ref.shape[0]

  @pl.when(t == 0)
  def _init():
    dq_scr[...] = jnp.zeros_like(dq_scr)

  start, is_full = _unpack(entries_ref[row * max_tiles + t], block_kv)

  def compute(masked: bool):
    k, v = k_ref[...], v_ref[...]
    logits = _dot(q_ref[...], k, _NT) * scale
    p = jnp.exp(logits - _lanes(lse_ref[...], block_kv))
    if masked:
      p = jnp.where(
          _visible(bounds_ref, start, block_q, block_kv, num_intervals), p, 0.0)
    dp = _dot(do_ref[...], v, _NT)
    ds = p * (dp - _lanes(delta_ref[...], block_kv))
    dq_scr[...] += _dot(ds.astype(k.dtype), k, _NN)

  pl.when(t < count_ref[row])(
      lambda: _when_full_or_partial(is_full, compute))

  @pl.when(t == max_tiles - 1)
  def _finalize():
    dq_ref[...] = (dq_scr[...] * scale).astype(dq_ref.dtype)


def _dkv_kernel(entries_ref, count_ref, bounds_ref, q_ref, k_ref, v_ref,
                do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_scr, dv_scr, *,
                scale, num_kv_tiles, max_tiles, num_intervals, groups):
  b, j, g, t = (pl.program_id(0), pl.program_id(2), pl.program_id(3),
                pl.program_id(4))
  row = b * num_kv_tiles + j
  block_q, block_kv = q_ref.shape[0], k_ref.shape[0]

  @pl.when((g == 0) & (t == 0))
  def _init():
    dk_scr[...] = jnp.zeros_like(dk_scr)
    dv_scr[...] = jnp.zeros_like(dv_scr)

  q_start, is_full = _unpack(entries_ref[row * max_tiles + t], block_q)

  def compute(masked: bool):
    # Transposed orientation [bk, bq]: per-query values lie along lanes.
    q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
    p_t = jnp.exp(_dot(k, q, _NT) * scale - lse_ref[:1, :])
    if masked:
      kv_idx = j * block_kv + lax.broadcasted_iota(
          jnp.int32, (block_kv, block_q), 0)
      bounds = [bounds_ref[n, :1, :] for n in range(2 * num_intervals)]
      p_t = jnp.where(mask_info_lib.in_intervals(kv_idx, bounds), p_t, 0.0)
    dv_scr[...] += _dot(p_t.astype(do.dtype), do, _NN)
    ds_t = p_t * (_dot(v, do, _NT) - delta_ref[:1, :])
    dk_scr[...] += _dot(ds_t.astype(q.dtype), q, _NN)

  pl.when(t < count_ref[row])(
      lambda: _when_full_or_partial(is_full, compute))

  @pl.when((g == groups - 1) & (t == max_tiles - 1))
  def _finalize():
    dk_ref[...] = (dk_scr[...] * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _rows_layout(x_BNT) -> jax.Array:
  """``[..., T]`` -> lane-replicated ``[..., T, 128]``."""
  return jnp.broadcast_to(x_BNT[..., None], (*x_BNT.shape, NUM_LANES))


def _lanes_layout(x_BNT) -> jax.Array:
  """``[..., T]`` -> sublane-replicated ``[..., 8, T]``."""
  return jnp.broadcast_to(x_BNT[..., None, :],
                          (*x_BNT.shape[:-1], NUM_SUBLANES, x_BNT.shape[-1]))


def _flat(tiles: mask_info_lib.TileList):
  return tiles.entries.reshape(-1), tiles.count.reshape(-1)


def _to_heads_major(x_BTHD):
  return jnp.swapaxes(x_BTHD, 1, 2)


def _q_major_specs(num_q_tiles: int, max_tiles: int, groups: int, block_q: int,
                   block_kv: int, head_dim: int):
  """Block specs of the q-major iteration (grid (b, h, q tile, kv entry)) shared by the
  forward and the dq pass: (q / o / do spec, kv spec, lane-row spec, bounds index map).
  The kv tile of step t is the t-th entry of the q tile's list (`entries`, scalar
  prefetched)."""

  def q_map(b, h, i, t, entries, count):
    del t, entries, count
    return b, h, i, 0

  def kv_map(b, h, i, t, entries, count):
    del count
    entry = entries[(b * num_q_tiles + i) * max_tiles + t]
    return b, lax.div(h, groups), lax.div(entry, 2), 0

  def bounds_map(b, h, i, t, entries, count):
    del h, t, entries, count
    return b, 0, i, 0

  return (pl.BlockSpec((None, None, block_q, head_dim), q_map),
          pl.BlockSpec((None, None, block_kv, head_dim), kv_map),
          pl.BlockSpec((None, None, block_q, NUM_LANES), q_map), bounds_map)


def forward(q_BTHD, k_BSKD, v_BSKD, info: mask_info_lib.BlockInfo, *,
            scale: float, block_q: int, block_kv: int, interpret: bool = False):
  """Returns ``(o_BTHD, lse_BHTL)``; lse is lane-replicated (L = 128)."""
  q, k, v = map(_to_heads_major, (q_BTHD, k_BSKD, v_BSKD))
  batch, num_heads, q_len, head_dim = q.shape
  groups = num_heads // k.shape[1]
  num_q_tiles = q_len // block_q
  max_tiles = info.fwd.entries.shape[-1]
  num_bounds = info.bounds.shape[1]

  q_spec, kv_spec, row_spec, bounds_map = _q_major_specs(
      num_q_tiles, max_tiles, groups, block_q, block_kv, head_dim)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(batch, num_heads, num_q_tiles, max_tiles),
      in_specs=[
          pl.BlockSpec((None, num_bounds, block_q, NUM_LANES), bounds_map),
          q_spec, kv_spec, kv_spec,
      ],
      out_specs=[q_spec, row_spec],
      scratch_shapes=[
          pltpu.VMEM((block_q, NUM_LANES), jnp.float32),
          pltpu.VMEM((block_q, NUM_LANES), jnp.float32),
          pltpu.VMEM((block_q, head_dim), jnp.float32),
      ],
  )
  o, lse = pl.pallas_call(
      functools.partial(_fwd_kernel, scale=scale, num_q_tiles=num_q_tiles,
                        max_tiles=max_tiles, num_intervals=num_bounds // 2),
      grid_spec=grid_spec,
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((batch, num_heads, q_len, NUM_LANES),
                                      jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel', 'parallel',
                               'arbitrary')),
      interpret=interpret,
      name='block_attention_fwd_tpu',
  )(*_flat(info.fwd), _rows_layout(info.bounds), q, k, v)
  return _to_heads_major(o), lse


def backward(q_BTHD, k_BSKD, v_BSKD, o_BTHD, lse_BHTL, do_BTHD,
             info: mask_info_lib.BlockInfo, *, scale: float, block_q: int,
             block_kv: int, interpret: bool = False):
  """Returns ``(dq, dk, dv)`` with the dtypes of q, k, v."""
  q, k, v, do = map(_to_heads_major, (q_BTHD, k_BSKD, v_BSKD, do_BTHD))
  batch, num_heads, q_len, head_dim = q.shape
  num_kv_heads, kv_len = k.shape[1], k.shape[2]
  groups = num_heads // num_kv_heads
  num_q_tiles, num_kv_tiles = q_len // block_q, kv_len // block_kv
  num_bounds = info.bounds.shape[1]
  delta_BHT = jnp.einsum('bthd,bthd->bht', o_BTHD.astype(jnp.float32),
                         do_BTHD.astype(jnp.float32))
  lse_BHT = lse_BHTL[..., 0]

  # dq: same iteration space as the forward pass.
  max_kv = info.fwd.entries.shape[-1]

  q_spec, kv_spec, row_spec, bounds_map = _q_major_specs(
      num_q_tiles, max_kv, groups, block_q, block_kv, head_dim)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, scale=scale, num_q_tiles=num_q_tiles,
                        max_tiles=max_kv, num_intervals=num_bounds // 2),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(batch, num_heads, num_q_tiles, max_kv),
          in_specs=[
              pl.BlockSpec((None, num_bounds, block_q, NUM_LANES), bounds_map),
              q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec,
          ],
          out_specs=q_spec,
          scratch_shapes=[pltpu.VMEM((block_q, head_dim), jnp.float32)],
      ),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel', 'parallel',
                               'arbitrary')),
      interpret=interpret,
      name='block_attention_dq_tpu',
  )(*_flat(info.fwd), _rows_layout(info.bounds), q, k, v, do,
    _rows_layout(lse_BHT), _rows_layout(delta_BHT))

  # dk/dv: per kv tile, the query heads of its group, then the q tile list.
  max_q = info.bwd.entries.shape[-1]

  def q_tile_of(b, j, t, entries):
    return lax.div(entries[(b * num_kv_tiles + j) * max_q + t], 2)

  def qd_map(b, kh, j, g, t, entries, count):
    del count
    return b, kh * groups + g, q_tile_of(b, j, t, entries), 0

  def lanes_map(b, kh, j, g, t, entries, count):
    del count
    return b, kh * groups + g, 0, q_tile_of(b, j, t, entries)

  def bounds_lanes_map(b, kh, j, g, t, entries, count):
    del kh, g, count
    return b, 0, 0, q_tile_of(b, j, t, entries)

  def kv_out_map(b, kh, j, g, t, entries, count):
    del g, t, entries, count
    return b, kh, j, 0

  qd_spec = pl.BlockSpec((None, None, block_q, head_dim), qd_map)
  lanes_spec = pl.BlockSpec((None, None, NUM_SUBLANES, block_q), lanes_map)
  kv_tile_spec = pl.BlockSpec((None, None, block_kv, head_dim), kv_out_map)
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, scale=scale, num_kv_tiles=num_kv_tiles,
                        max_tiles=max_q, num_intervals=num_bounds // 2,
                        groups=groups),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(batch, num_kv_heads, num_kv_tiles, groups, max_q),
          in_specs=[
              pl.BlockSpec((None, num_bounds, NUM_SUBLANES, block_q),
                           bounds_lanes_map),
              qd_spec, kv_tile_spec, kv_tile_spec, qd_spec, lanes_spec,
              lanes_spec,
          ],
          out_specs=[kv_tile_spec, kv_tile_spec],
          scratch_shapes=[pltpu.VMEM((block_kv, head_dim), jnp.float32),
                          pltpu.VMEM((block_kv, head_dim), jnp.float32)],
      ),
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel', 'parallel',
                               'arbitrary', 'arbitrary')),
      interpret=interpret,
      name='block_attention_dkv_tpu',
  )(*_flat(info.bwd), _lanes_layout(info.bounds), q, k, v, do,
    _lanes_layout(lse_BHT), _lanes_layout(delta_BHT))
  return dq.swapaxes(1, 2), dk.swapaxes(1, 2), dv.swapaxes(1, 2)
