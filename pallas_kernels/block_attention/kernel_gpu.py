"""Portable Pallas block-sparse flash attention: the GPU and interpret kernels.

Lowering choice: ``pl.pallas_call`` with ``pallas.triton.CompilerParams``, i.e.
Pallas's Triton lowering that ships inside jaxlib. It works unchanged on
jax 0.10-0.12 and on any CUDA GPU, and it accepts the dynamic trip counts and
scalar loads the sparse loop needs. Mosaic GPU (the default for plain
``pl.pallas_call`` on jax >= 0.11, moving to ``plgpu.kernel``) is sm90+ only and
its API is still changing, so this kernel does not use it; jax may log a
deprecation warning for the Triton backend. With ``interpret=True`` the same
kernel bodies run on CPU (``implementation='interpret'``). The Triton lowering is
checked from CPU by lowering for 'cuda' in the tests.

Layout: q/o ``[batch, T, H, D]``, k/v ``[batch, S, K, D]`` with T, S padded to
the tile sizes and D padded to a power of two (done by ``api``).

Grids and sparsity (see ``mask_info``):

* forward and dq: one program per (q tile, batch, head); the program loops
  ``fwd.count[b, q_tile]`` times over the compacted kv tile list, so empty tiles
  cost neither loads nor math. Full tiles skip the mask (``lax.cond`` on the
  tile's class bit).
* dk/dv: one program per (kv tile, batch, kv head); it loops over the query
  heads of its group and over ``bwd.count[b, kv_tile]`` q tiles, accumulating
  dk/dv of the kv head directly (no per-query-head copies).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton
import jax.numpy as jnp

from pallas_kernels.block_attention import mask_info as mask_info_lib
from pallas_kernels.block_attention.reference import MASK_VALUE


def _dot(a, b, contract_a: int, contract_b: int) -> jax.Array:
  """2-D dot_general with fp32 accumulation (IEEE fp32 for fp32 inputs)."""
  exact = a.dtype == jnp.float32 and b.dtype == jnp.float32
  return lax.dot_general(
      a, b, (((contract_a,), (contract_b,)), ((), ())),
      preferred_element_type=jnp.float32,
      precision=lax.Precision.HIGHEST if exact else None)


def _visible(bounds, kv_start, block_kv: int) -> jax.Array:
  """[bq, bk] mask from per-row intervals ``bounds = [lo_0, hi_0, ...]``."""
  kv_idx = kv_start + jnp.arange(block_kv, dtype=jnp.int32)[None, :]
  return mask_info_lib.in_intervals(kv_idx, bounds)


def _load_bounds(bounds_ref, rows, num_intervals: int):
  return [bounds_ref[j, rows][:, None] for j in range(2 * num_intervals)]


def _unpack(entry, tile: int):
  """Entry ``2 * index + is_full`` -> (start offset, is_full)."""
  start = pl.multiple_of(lax.div(entry, 2) * tile, tile)
  return start, lax.rem(entry, 2) == 1


def _fwd_kernel(entries_ref, count_ref, bounds_ref, q_ref, k_ref, v_ref,
                o_ref, lse_ref, *visits_ref, scale, block_kv, num_intervals):
  q_tile, b = pl.program_id(0), pl.program_id(1)
  block_q, head_dim = q_ref.shape
  q = q_ref[...]
  bounds = _load_bounds(bounds_ref, slice(None), num_intervals)

  def body(t, carry):
    acc, m_prev, l_prev = carry[:3]
    start, is_full = _unpack(entries_ref[b, q_tile, t], block_kv)
    k = k_ref[pl.ds(start, block_kv), :]
    v = v_ref[pl.ds(start, block_kv), :]
    s = _dot(q, k, 1, 1) * scale

    def update(masked: bool):
      logits = s
      if masked:
        visible = _visible(bounds, start, block_kv)
        logits = jnp.where(visible, logits, MASK_VALUE)
      m_next = jnp.maximum(m_prev, logits.max(axis=-1))
      p = jnp.exp(logits - m_next[:, None])
      if masked:
        p = jnp.where(visible, p, 0.0)
      alpha = jnp.exp(m_prev - m_next)
      acc_next = alpha[:, None] * acc + _dot(p.astype(v.dtype), v, 1, 0)
      return acc_next, m_next, alpha * l_prev + p.sum(axis=-1)

    new = lax.cond(is_full, lambda: update(False), lambda: update(True))
    return new + tuple(n + 1 for n in carry[3:])

  init = (jnp.zeros((block_q, head_dim), jnp.float32),
          jnp.full((block_q,), MASK_VALUE, jnp.float32),
          jnp.zeros((block_q,), jnp.float32))
  init += (jnp.int32(0),) * len(visits_ref)
  acc, m, l, *visits = lax.fori_loop(0, count_ref[b, q_tile], body, init)
  empty = l == 0.0
  o_ref[...] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
  # +inf makes exp(s - lse) = 0 in the backward pass for fully masked rows.
  lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log(l))
  for ref, n in zip(visits_ref, visits):
    ref[b, pl.program_id(2), q_tile] = n


def _dq_kernel(entries_ref, count_ref, bounds_ref, q_ref, k_ref, v_ref,
               do_ref, lse_ref, delta_ref, dq_ref, *, scale, block_kv,
               num_intervals):
  q_tile, b = pl.program_id(0), pl.program_id(1)
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
  bounds = _load_bounds(bounds_ref, slice(None), num_intervals)

  def body(t, dq):
    start, is_full = _unpack(entries_ref[b, q_tile, t], block_kv)
    k = k_ref[pl.ds(start, block_kv), :]
    v = v_ref[pl.ds(start, block_kv), :]
    p = jnp.exp(_dot(q, k, 1, 1) * scale - lse)
    p = lax.cond(is_full, lambda: p, lambda: jnp.where(
        _visible(bounds, start, block_kv), p, 0.0))
    ds = p * (_dot(do, v, 1, 1) - delta)
    return dq + _dot(ds.astype(k.dtype), k, 1, 0)

  dq = lax.fori_loop(0, count_ref[b, q_tile], body,
                     jnp.zeros(q_ref.shape, jnp.float32))
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(entries_ref, count_ref, bounds_ref, q_ref, k_ref, v_ref,
                do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, scale, block_q,
                groups, num_intervals):
  kv_tile, b = pl.program_id(0), pl.program_id(1)
  block_kv, head_dim = k_ref.shape
  kv_start = kv_tile * block_kv
  k, v = k_ref[...], v_ref[...]
  count = count_ref[b, kv_tile]

  def head(g, carry):
    def tile(t, carry):
      dk, dv = carry
      q_start, is_full = _unpack(entries_ref[b, kv_tile, t], block_q)
      rows = pl.ds(q_start, block_q)
      q, do = q_ref[rows, g, :], do_ref[rows, g, :]
      lse, delta = lse_ref[g, rows][:, None], delta_ref[g, rows][:, None]
      p = jnp.exp(_dot(q, k, 1, 1) * scale - lse)
      p = lax.cond(is_full, lambda: p, lambda: jnp.where(_visible(
          _load_bounds(bounds_ref, rows, num_intervals), kv_start, block_kv),
                                                         p, 0.0))
      dv = dv + _dot(p.astype(do.dtype), do, 0, 0)
      ds = p * (_dot(do, v, 1, 1) - delta)
      return dk + _dot(ds.astype(q.dtype), q, 0, 0), dv

    return lax.fori_loop(0, count, tile, carry)

  zeros = jnp.zeros((block_kv, head_dim), jnp.float32)
  dk, dv = lax.fori_loop(0, groups, head, (zeros, zeros))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _full_spec(x: jax.Array) -> pl.BlockSpec:
  return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _compiler_params(head_dim: int):
  return pl_triton.CompilerParams(num_warps=4 if head_dim <= 64 else 8,
                                  num_stages=2)


def forward(q_BTHD, k_BSKD, v_BSKD, info: mask_info_lib.BlockInfo, *,
            scale: float, block_q: int, block_kv: int, interpret: bool = False,
            count_visits: bool = False):
  """Returns ``(o_BTHD, lse_BHT)`` (plus ``visits [batch, H, num_q_tiles]``).

  ``visits`` counts the kv tiles each program's loop actually processed; it is
  for tests that check the sparse loop.
  """
  batch, q_len, num_heads, head_dim = q_BTHD.shape
  kv_len, num_kv_heads = k_BSKD.shape[1:3]
  groups = num_heads // num_kv_heads
  num_q_tiles = q_len // block_q
  num_intervals = info.bounds.shape[1] // 2
  entries, count = info.fwd.entries, info.fwd.count
  kernel = functools.partial(_fwd_kernel, scale=scale, block_kv=block_kv,
                             num_intervals=num_intervals)
  kv_spec = pl.BlockSpec((None, kv_len, None, head_dim),
                         lambda i, b, h: (b, 0, lax.div(h, groups), 0))
  q_spec = pl.BlockSpec((None, block_q, None, head_dim),
                        lambda i, b, h: (b, i, h, 0))
  out_shape = [jax.ShapeDtypeStruct(q_BTHD.shape, q_BTHD.dtype),
               jax.ShapeDtypeStruct((batch, num_heads, q_len), jnp.float32)]
  out_specs = [q_spec,
               pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))]
  if count_visits:
    out_shape.append(jax.ShapeDtypeStruct((batch, num_heads, num_q_tiles),
                                          jnp.int32))
    out_specs.append(_full_spec(out_shape[-1]))
  return pl.pallas_call(
      kernel,
      grid=(num_q_tiles, batch, num_heads),
      in_specs=[
          _full_spec(entries), _full_spec(count),
          pl.BlockSpec((None, 2 * num_intervals, block_q),
                       lambda i, b, h: (b, 0, i)),
          q_spec, kv_spec, kv_spec,
      ],
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=_compiler_params(head_dim),
      interpret=interpret,
      name='block_attention_fwd',
  )(entries, count, info.bounds, q_BTHD, k_BSKD, v_BSKD)


def backward(q_BTHD, k_BSKD, v_BSKD, o_BTHD, lse_BHT, do_BTHD,
             info: mask_info_lib.BlockInfo, *, scale: float, block_q: int,
             block_kv: int, interpret: bool = False):
  """Returns ``(dq, dk, dv)`` with the dtypes of q, k, v."""
  batch, q_len, num_heads, head_dim = q_BTHD.shape
  kv_len, num_kv_heads = k_BSKD.shape[1:3]
  groups = num_heads // num_kv_heads
  num_intervals = info.bounds.shape[1] // 2
  delta_BHT = jnp.einsum('bthd,bthd->bht', o_BTHD.astype(jnp.float32),
                         do_BTHD.astype(jnp.float32))
  params = _compiler_params(head_dim)

  q_spec = pl.BlockSpec((None, block_q, None, head_dim),
                        lambda i, b, h: (b, i, h, 0))
  row_spec = pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))
  kv_full = pl.BlockSpec((None, kv_len, None, head_dim),
                         lambda i, b, h: (b, 0, lax.div(h, groups), 0))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, scale=scale, block_kv=block_kv,
                        num_intervals=num_intervals),
      grid=(q_len // block_q, batch, num_heads),
      in_specs=[
          _full_spec(info.fwd.entries), _full_spec(info.fwd.count),
          pl.BlockSpec((None, 2 * num_intervals, block_q),
                       lambda i, b, h: (b, 0, i)),
          q_spec, kv_full, kv_full, q_spec, row_spec, row_spec,
      ],
      out_specs=q_spec,
      out_shape=jax.ShapeDtypeStruct(q_BTHD.shape, q_BTHD.dtype),
      compiler_params=params,
      interpret=interpret,
      name='block_attention_dq',
  )(info.fwd.entries, info.fwd.count, info.bounds, q_BTHD, k_BSKD, v_BSKD,
    do_BTHD, lse_BHT, delta_BHT)

  q_group = pl.BlockSpec((None, q_len, groups, head_dim),
                         lambda j, b, g: (b, 0, g, 0))
  rows_group = pl.BlockSpec((None, groups, q_len), lambda j, b, g: (b, g, 0))
  kv_spec = pl.BlockSpec((None, block_kv, None, head_dim),
                         lambda j, b, g: (b, j, g, 0))
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, scale=scale, block_q=block_q,
                        groups=groups, num_intervals=num_intervals),
      grid=(kv_len // block_kv, batch, num_kv_heads),
      in_specs=[
          _full_spec(info.bwd.entries), _full_spec(info.bwd.count),
          pl.BlockSpec((None, 2 * num_intervals, q_len),
                       lambda j, b, g: (b, 0, 0)),
          q_group, kv_spec, kv_spec, q_group, rows_group, rows_group,
      ],
      out_specs=[kv_spec, kv_spec],
      out_shape=[jax.ShapeDtypeStruct(k_BSKD.shape, k_BSKD.dtype),
                 jax.ShapeDtypeStruct(v_BSKD.shape, v_BSKD.dtype)],
      compiler_params=params,
      interpret=interpret,
      name='block_attention_dkv',
  )(info.bwd.entries, info.bwd.count, info.bounds, q_BTHD, k_BSKD, v_BSKD,
    do_BTHD, lse_BHT, delta_BHT)
  return dq, dk, dv
