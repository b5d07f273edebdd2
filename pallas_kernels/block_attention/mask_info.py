"""Tile classification and compacted tile lists, computed from runtime offsets.

As in splash attention, every (q tile, kv tile) pair is classified as EMPTY
(nothing visible: never loaded), PARTIAL (some entries visible: the kernel
evaluates the mask) or FULL (everything visible: the kernel skips the mask).
Unlike splash, the offsets (e.g. DFlash anchors) are runtime arrays, so all of
this is jnp code that runs under ``jit``; only tile sizes are static. The cost is
O(Q x num_kv_tiles) integer work per batch element, never a dense mask.

The kernels consume:

* ``bounds``: ``[batch, 2I, Q_pad]`` int32, rows ``lo_0, hi_0, lo_1, hi_1, ...``:
  query row r sees kv in the union of ``[lo_i[r], hi_i[r])`` (clipped to the
  real kv length, empty for padded rows).
* ``TileList``: for each row tile, the list of non-empty column tiles in
  increasing order, packed as ``2 * col + is_full``, followed by padding that
  repeats the last entry (so a TPU pipeline re-uses the block instead of
  fetching a new one), plus the count of real entries. The kernels loop exactly
  ``count`` times. ``fwd`` lists kv tiles per q tile (forward and dq),
  ``bwd`` lists q tiles per kv tile (dk/dv).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.block_attention import masks as masks_lib

EMPTY, PARTIAL, FULL = 0, 1, 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TileList:
  """Compacted non-empty tiles: ``entries [batch, rows, cols]``, ``count``."""

  entries: jax.Array
  count: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockInfo:
  """Everything the kernels need about the mask for one call."""

  bounds: jax.Array
  fwd: TileList
  bwd: TileList


def in_intervals(kv_idx: jax.Array, bounds) -> jax.Array:
  """``OR_i (lo_i <= kv_idx < hi_i)`` for ``bounds = [lo_0, hi_0, lo_1, ...]``.

  The in-kernel mask of a partial tile (GPU, TPU and interpret kernels).
  """
  visible = None
  for lo, hi in zip(bounds[0::2], bounds[1::2]):
    part = (kv_idx >= lo) & (kv_idx < hi)
    visible = part if visible is None else visible | part
  return visible


def row_bounds(mask: masks_lib.AttentionMask, offsets_B: jax.Array,
               q_len: int, kv_len: int, q_pad: int) -> jax.Array:
  """Per-row kv intervals ``[batch, 2 * num_intervals, q_pad]`` (int32).

  Args:
    mask: a mask already bound to the shapes with ``mask.resolve``.
    offsets_B: offsets from ``mask.prepare_offsets`` (leading batch dim).
    q_len, kv_len: real (unpadded) lengths.
    q_pad: padded query length (rows >= q_len get empty intervals).
  """
  q_idx = jnp.arange(q_pad, dtype=jnp.int32)

  def one(offsets):
    lo_QI, hi_QI = mask.intervals(q_idx, offsets)
    lo_QI = jnp.clip(lo_QI, 0, kv_len)
    hi_QI = jnp.maximum(jnp.clip(hi_QI, 0, kv_len), lo_QI)
    valid = (q_idx < q_len)[:, None]
    lo_QI, hi_QI = jnp.where(valid, lo_QI, 0), jnp.where(valid, hi_QI, 0)
    return jnp.stack([lo_QI, hi_QI], axis=-1).reshape(q_pad, -1).T

  return jax.vmap(one)(offsets_B).astype(jnp.int32)


def tile_classes(bounds: jax.Array, q_len: int, kv_len: int, block_q: int,
                 block_kv: int) -> jax.Array:
  """Classifies tiles: ``[batch, num_q_tiles, num_kv_tiles]`` of EMPTY/PARTIAL/FULL."""
  batch, _, q_pad = bounds.shape
  num_q, num_kv = q_pad // block_q, -(-kv_len // block_kv)
  lo, hi = bounds[:, 0::2, :, None], bounds[:, 1::2, :, None]  # [b, I, Q, 1]
  start = jnp.arange(num_kv, dtype=jnp.int32) * block_kv
  end = start + block_kv
  touches = ((lo < end) & (hi > start) & (lo < hi)).any(axis=1)  # [b, Q, nk]
  covers = ((lo <= start) & (hi >= end)).any(axis=1)
  valid = (jnp.arange(q_pad) < q_len)[None, :, None]
  touches = (touches & valid).reshape(batch, num_q, block_q, num_kv)
  covers = (covers | ~valid).reshape(batch, num_q, block_q, num_kv)
  nonempty = touches.any(axis=2)
  full = covers.all(axis=2) & nonempty
  return jnp.where(full, FULL, jnp.where(nonempty, PARTIAL, EMPTY)).astype(
      jnp.int32)


def compact(classes: jax.Array, width: int | None = None) -> TileList:
  """Per row of ``classes [batch, rows, cols]``, lists the non-empty columns.

  ``width`` (default ``cols``) is the static list length; it must be at least
  the largest number of non-empty tiles in a row (see ``max_kv_tiles``).
  """
  width = classes.shape[-1] if width is None else width
  order = jnp.argsort(classes == EMPTY, axis=-1, stable=True).astype(jnp.int32)
  count = (classes != EMPTY).sum(axis=-1).astype(jnp.int32)
  packed = 2 * order + (jnp.take_along_axis(classes, order, -1) == FULL)
  slot = jnp.minimum(jnp.arange(width, dtype=jnp.int32),
                     jnp.maximum(count[..., None] - 1, 0))
  entries = jnp.take_along_axis(packed, slot, -1).astype(jnp.int32)
  return TileList(entries=entries, count=count)


def build_block_info(mask: masks_lib.AttentionMask, offsets_B: jax.Array,
                     q_len: int, kv_len: int, block_q: int,
                     block_kv: int) -> BlockInfo:
  """Bounds plus forward and backward tile lists for padded tiling.

  ``mask`` must be resolved and ``offsets_B`` prepared (see ``masks``). The
  query axis is padded to a multiple of ``block_q`` and the kv axis to a
  multiple of ``block_kv``.
  """
  q_pad = -(-q_len // block_q) * block_q
  bounds = row_bounds(mask, offsets_B, q_len, kv_len, q_pad)
  classes = tile_classes(bounds, q_len, kv_len, block_q, block_kv)
  width = mask.max_kv_tiles(q_len, kv_len, block_q, block_kv)
  return BlockInfo(bounds=bounds, fwd=compact(classes, width),
                   bwd=compact(jnp.swapaxes(classes, 1, 2)))
