"""Computable attention masks for block attention.

A mask is a frozen, hashable dataclass: its fields are static (block size,
context length, window) and it never holds a dense array. Runtime values that
change from call to call (per-batch anchors, a query position offset, a valid
context length) are passed separately as integer arrays, the *offsets*.

Every mask offers three views of the same rule:

* ``mask(q_idx, kv_idx, offsets) -> bool``: the written definition, evaluated
  elementwise on broadcasting int arrays for ONE batch element (``offsets`` is
  that element's slice). The reference attention uses this view.
* ``mask.intervals(q_idx, offsets) -> (lo_QI, hi_QI)``: for each query row, at
  most ``num_intervals`` half-open kv ranges ``[lo, hi)`` whose union is the
  row's visible set. The kernels and ``mask_info`` use this view, so the kernel
  needs only O(Q) integers per batch element and no integer division.
* ``mask.dense(q_len, kv_len, offsets)``: a NumPy ``[Q, KV]`` bool matrix, for
  tests and debugging only (never inside ``jit``).

Offsets per family (``prepare_offsets`` turns them into ``[batch, ...]`` int32):

* ``CausalMask``: ``q_offset`` ``[batch]`` (or a scalar; default 0), the absolute
  position of query 0.
* ``DFlashTrainMask``: ``anchors`` ``[batch, N]`` (required); anchor < 0 marks an
  invalid (padded) block that sees nothing.
* ``DFlashDraftMask``: ``context_len`` ``[batch]`` (or a scalar; required), the
  number of valid keys in the cache.
* ``BD3LMMask``: none (pass ``None``).
* ``TreeMask``: ``[batch, 1 + N]`` (required): ``context_len``, then the N node
  parents (-1 for the root and padding nodes).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np


def _window_lo(pos: jax.Array, window: int | None) -> jax.Array:
  """Smallest kv index strictly greater than ``pos - window`` (0 if none)."""
  if window is None:
    return jnp.zeros_like(pos)
  return jnp.maximum(pos - window + 1, 0)


def _check_window(window: int | None) -> None:
  if window is not None and window < 1:
    raise ValueError(f'window must be >= 1 or None, got {window}.')


class AttentionMask(abc.ABC):
  """Base class of the computable masks (subclasses are frozen dataclasses)."""

  num_intervals: ClassVar[int]

  def resolve(self, q_len: int, kv_len: int) -> AttentionMask:
    """Validates the mask against static shapes; returns the bound mask."""
    del q_len, kv_len
    return self

  @abc.abstractmethod
  def prepare_offsets(self, offsets, batch: int, q_len: int) -> jax.Array:
    """Returns the runtime offsets as an int32 array with a leading batch dim."""

  @abc.abstractmethod
  def __call__(self, q_idx, kv_idx, offsets) -> jax.Array:
    """Written definition: bool array, broadcast of ``q_idx`` and ``kv_idx``."""

  @abc.abstractmethod
  def intervals(self, q_idx_Q, offsets) -> tuple[jax.Array, jax.Array]:
    """Per-row visible kv ranges ``[lo, hi)``, each ``[Q, num_intervals]``."""

  def max_kv_tiles(self, q_len: int, kv_len: int, block_q: int,
                   block_kv: int) -> int:
    """Static upper bound on the non-empty kv tiles of any q tile."""
    del q_len, block_q
    return -(-kv_len // block_kv)

  def dense(self, q_len: int, kv_len: int, offsets=None) -> np.ndarray:
    """NumPy ``[q_len, kv_len]`` bool matrix for one batch element's offsets.

    Tests and debugging only: never call it inside ``jit``.
    """
    mask = self.resolve(q_len, kv_len)
    offsets = mask.prepare_offsets(offsets, 1, q_len)[0]
    return np.asarray(_dense(mask, q_len, kv_len, offsets))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _dense(mask: AttentionMask, q_len: int, kv_len: int, offsets) -> jax.Array:
  q_idx = jnp.arange(q_len, dtype=jnp.int32)[:, None]
  kv_idx = jnp.arange(kv_len, dtype=jnp.int32)[None, :]
  return mask(q_idx, kv_idx, offsets)


def _batch_vector(x, batch: int, name: str) -> jax.Array:
  x = jnp.asarray(x, dtype=jnp.int32)
  if x.ndim > 1 or (x.ndim == 1 and x.shape[0] not in (1, batch)):
    raise ValueError(f'{name} must be a scalar or have shape [{batch}], got '
                     f'{x.shape}.')
  return jnp.broadcast_to(x.reshape(-1), (batch,))


@dataclasses.dataclass(frozen=True)
class CausalMask(AttentionMask):
  """Causal attention; query i sits at absolute position ``q_offset + i``.

  Keys are at positions 0..S-1. A query at position p sees kv <= p, and with a
  sliding window also kv > p - window. Offsets: ``q_offset`` (scalar or
  ``[batch]``, default 0), for decoding a chunk at position > 0.
  """

  window: int | None = None
  num_intervals: ClassVar[int] = 1

  def __post_init__(self):
    _check_window(self.window)

  def prepare_offsets(self, offsets, batch, q_len):
    del q_len
    return _batch_vector(0 if offsets is None else offsets, batch, 'q_offset')

  def __call__(self, q_idx, kv_idx, offsets):
    q_idx, kv_idx = jnp.broadcast_arrays(q_idx, kv_idx)
    pos = q_idx + (0 if offsets is None else offsets)
    visible = kv_idx <= pos
    if self.window is not None:
      visible &= kv_idx > pos - self.window
    return visible

  def intervals(self, q_idx_Q, offsets):
    pos = q_idx_Q + offsets
    return _window_lo(pos, self.window)[:, None], (pos + 1)[:, None]


@dataclasses.dataclass(frozen=True)
class DFlashTrainMask(AttentionMask):
  """DFlash drafter training mask (docs/DESIGN.md, "Kernels").

  Q = N·B block queries; KV = [S context keys | N·B block keys]. A query in
  block b with anchor a_b sees context kv < a_b (strictly; with a window also
  kv > a_b - window), every key of its own block (bidirectional), and nothing
  from other blocks. A block with a_b < 0 is padding and sees nothing.
  Offsets: ``anchors`` ``[batch, N]`` int.
  """

  block_size: int
  context_len: int
  window: int | None = None
  num_intervals: ClassVar[int] = 2

  def __post_init__(self):
    _check_window(self.window)
    if self.block_size < 1 or self.context_len < 0:
      raise ValueError(f'bad DFlashTrainMask fields: {self}.')

  def resolve(self, q_len, kv_len):
    if q_len % self.block_size or kv_len != self.context_len + q_len:
      raise ValueError(
          f'DFlashTrainMask(B={self.block_size}, S={self.context_len}) needs '
          f'Q = N*B and KV = S + Q; got Q={q_len}, KV={kv_len}.')
    return self

  def prepare_offsets(self, offsets, batch, q_len):
    if offsets is None:
      raise ValueError('DFlashTrainMask needs offsets=anchors [batch, N].')
    anchors = jnp.asarray(offsets, dtype=jnp.int32)
    num_blocks = q_len // self.block_size
    if anchors.ndim == 1:
      anchors = anchors[None]
    if anchors.ndim != 2 or anchors.shape[1] != num_blocks or anchors.shape[
        0] not in (1, batch):
      raise ValueError(f'anchors must have shape [{batch}, {num_blocks}], got '
                       f'{jnp.shape(offsets)}.')
    return jnp.broadcast_to(anchors, (batch, num_blocks))

  def max_kv_tiles(self, q_len, kv_len, block_q, block_kv):
    # Context tiles, plus the own-block keys of the rows of one q tile: a range
    # of at most block_q + 2 (B - 1) keys starting at S + (row0 // B) * B.
    own_keys = block_q + 2 * (self.block_size - 1)
    bound = -(-self.context_len // block_kv) + -(-own_keys // block_kv) + 1
    return min(bound, -(-kv_len // block_kv))

  def _anchor(self, q_idx, anchors_N):
    block = q_idx // self.block_size
    return block, jnp.take(anchors_N, block, mode='clip')

  def __call__(self, q_idx, kv_idx, offsets):
    q_idx, kv_idx = jnp.broadcast_arrays(q_idx, kv_idx)
    block, anchor = self._anchor(q_idx, offsets)
    s = self.context_len
    context = (kv_idx < s) & (kv_idx < anchor)
    if self.window is not None:
      context &= kv_idx > anchor - self.window
    own = (kv_idx >= s) & ((kv_idx - s) // self.block_size == block)
    return (anchor >= 0) & (context | own)

  def intervals(self, q_idx_Q, offsets):
    block, anchor = self._anchor(q_idx_Q, offsets)
    valid = anchor >= 0
    ctx_lo = _window_lo(anchor, self.window)
    ctx_hi = jnp.minimum(anchor, self.context_len)
    own_lo = self.context_len + block * self.block_size
    own_hi = own_lo + self.block_size
    lo = jnp.stack([ctx_lo, own_lo], axis=-1)
    hi = jnp.stack([ctx_hi, own_hi], axis=-1)
    return jnp.where(valid[:, None], lo, 0), jnp.where(valid[:, None], hi, 0)


@dataclasses.dataclass(frozen=True)
class DFlashDraftMask(AttentionMask):
  """DFlash drafting mask: one block of B queries over [cache | block keys].

  KV = [cache of capacity C | B block keys]. Each query sees the valid context
  kv < context_len (with a window also kv > context_len - window, i.e. relative
  to the block's anchor position as in ``DFlashTrainMask``) and all B block keys.
  ``cache_len`` (C) is filled in from the shapes by ``resolve`` when left None.
  Offsets: ``context_len`` (scalar or ``[batch]``).
  """

  block_size: int
  window: int | None = None
  cache_len: int | None = None
  num_intervals: ClassVar[int] = 2

  def __post_init__(self):
    _check_window(self.window)

  def resolve(self, q_len, kv_len):
    cache_len = kv_len - self.block_size
    if q_len != self.block_size or cache_len < 0 or (
        self.cache_len not in (None, cache_len)):
      raise ValueError(
          f'DFlashDraftMask(B={self.block_size}, C={self.cache_len}) needs '
          f'Q = B and KV = C + B; got Q={q_len}, KV={kv_len}.')
    return dataclasses.replace(self, cache_len=cache_len)

  def _require_cache_len(self) -> int:
    if self.cache_len is None:
      raise ValueError('DFlashDraftMask.cache_len is unset: call resolve().')
    return self.cache_len

  def prepare_offsets(self, offsets, batch, q_len):
    del q_len
    if offsets is None:
      raise ValueError('DFlashDraftMask needs offsets=context_len [batch].')
    return _batch_vector(offsets, batch, 'context_len')

  def __call__(self, q_idx, kv_idx, offsets):
    q_idx, kv_idx = jnp.broadcast_arrays(q_idx, kv_idx)
    c = self._require_cache_len()
    context = (kv_idx < c) & (kv_idx < offsets)
    if self.window is not None:
      context &= kv_idx > offsets - self.window
    block = (kv_idx >= c) & (kv_idx < c + self.block_size)
    return context | block

  def intervals(self, q_idx_Q, offsets):
    c = self._require_cache_len()
    ctx_len = jnp.broadcast_to(offsets, q_idx_Q.shape)
    lo = jnp.stack([_window_lo(ctx_len, self.window),
                    jnp.full_like(q_idx_Q, c)], axis=-1)
    hi = jnp.stack([jnp.minimum(ctx_len, c),
                    jnp.full_like(q_idx_Q, c + self.block_size)], axis=-1)
    return lo, hi


@dataclasses.dataclass(frozen=True)
class BD3LMMask(AttentionMask):
  """BD3-LM mask over the packed ``[x_t ; x_0]`` sequence of length 2L.

  BD3-LM (arXiv 2503.09573), ``block_diff_mask``: block-diagonal (same half, same block)
  ∪ offset block-causal (x_t query sees x_0 blocks strictly before its block)
  ∪ block-causal (x_0 query sees x_0 blocks up to and including its block).
  No offsets.
  """

  block_size: int
  seq_len: int
  num_intervals: ClassVar[int] = 2

  def resolve(self, q_len, kv_len):
    if q_len != 2 * self.seq_len or kv_len != 2 * self.seq_len:
      raise ValueError(f'BD3LMMask(L={self.seq_len}) needs Q = KV = 2L; got '
                       f'Q={q_len}, KV={kv_len}.')
    return self

  def prepare_offsets(self, offsets, batch, q_len):
    del q_len
    if offsets is not None:
      raise ValueError('BD3LMMask takes no offsets.')
    return jnp.zeros((batch,), jnp.int32)

  def __call__(self, q_idx, kv_idx, offsets=None):
    del offsets
    q_idx, kv_idx = jnp.broadcast_arrays(q_idx, kv_idx)
    length, b = self.seq_len, self.block_size
    q_clean, kv_clean = q_idx >= length, kv_idx >= length
    q_block = (q_idx - length * q_clean) // b
    kv_block = (kv_idx - length * kv_clean) // b
    diag = (q_block == kv_block) & (q_clean == kv_clean)
    offset_causal = (q_block > kv_block) & kv_clean & ~q_clean
    causal = (q_block >= kv_block) & kv_clean & q_clean
    return diag | offset_causal | causal

  def intervals(self, q_idx_Q, offsets=None):
    del offsets
    length, b = self.seq_len, self.block_size
    clean = q_idx_Q >= length
    block = (q_idx_Q - length * clean) // b
    # x_t query: own noisy block, then clean blocks < block.
    # x_0 query: clean blocks <= block (its own block included), one range.
    noisy_lo, noisy_hi = block * b, jnp.minimum((block + 1) * b, length)
    clean_hi = length + jnp.where(clean, jnp.minimum((block + 1) * b, length),
                                  block * b)
    lo = jnp.stack([jnp.where(clean, 0, noisy_lo),
                    jnp.full_like(q_idx_Q, length)], axis=-1)
    hi = jnp.stack([jnp.where(clean, 0, noisy_hi), clean_hi], axis=-1)
    return lo, hi


@dataclasses.dataclass(frozen=True)
class TreeMask(AttentionMask):
  """Tree verification mask: N node queries over a cache that holds the tree.

  Node n's key is kv index ``context_len + n`` (the tree is written into the cache
  after the committed prefix). Query n sees the prefix kv < context_len and the keys of
  its ancestors and itself. Offsets ``[batch, 1 + N]`` int: ``context_len``, then
  ``parents`` (parent < node for real nodes; -1 for the root and padding nodes, which see
  the prefix and themselves). ``max_depth`` must bound every node's depth: the interval
  view is the prefix plus one single-key interval per node of the path to the root.
  """

  num_nodes: int
  max_depth: int

  def __post_init__(self):
    if self.num_nodes < 1 or not 0 <= self.max_depth < self.num_nodes:
      raise ValueError(f'TreeMask needs num_nodes >= 1 and 0 <= max_depth < num_nodes, '
                       f'got {self}.')

  @property
  def num_intervals(self) -> int:
    return self.max_depth + 2

  def resolve(self, q_len, kv_len):
    if q_len != self.num_nodes or kv_len < q_len:
      raise ValueError(f'TreeMask(N={self.num_nodes}) needs Q = N and KV >= N; got '
                       f'Q={q_len}, KV={kv_len}.')
    return self

  def prepare_offsets(self, offsets, batch, q_len):
    if offsets is None:
      raise ValueError('TreeMask needs offsets=[context_len, parents...] [batch, 1 + N].')
    offsets = jnp.asarray(offsets, dtype=jnp.int32)
    if offsets.ndim == 1:
      offsets = offsets[None]
    if offsets.ndim != 2 or offsets.shape[1] != 1 + q_len or offsets.shape[0] not in (
        1, batch):
      raise ValueError(f'TreeMask offsets must have shape [{batch}, {1 + q_len}], got '
                       f'{jnp.shape(offsets)}.')
    return jnp.broadcast_to(offsets, (batch, 1 + q_len))

  def __call__(self, q_idx, kv_idx, offsets):
    q_idx, kv_idx = jnp.broadcast_arrays(q_idx, kv_idx)
    n = self.num_nodes
    context_len, parents = offsets[0], offsets[1:]
    # Ancestor-or-self relation: transitive closure of the parent edges by squaring.
    reach = jnp.eye(n, dtype=jnp.int32) + jax.nn.one_hot(parents, n, dtype=jnp.int32)
    for _ in range(max(n - 1, 1).bit_length()):
      reach = jnp.minimum(reach + reach @ reach, 1)
    node = kv_idx - context_len
    in_tree = (node >= 0) & (node < n)
    ancestor = reach[jnp.clip(q_idx, 0, n - 1), jnp.clip(node, 0, n - 1)] > 0
    return (kv_idx < context_len) | (in_tree & ancestor)

  def intervals(self, q_idx_Q, offsets):
    context_len, parents = offsets[0], offsets[1:]
    node = jnp.clip(q_idx_Q, 0, self.num_nodes - 1)
    lo, hi = [jnp.zeros_like(q_idx_Q)], [jnp.broadcast_to(context_len, q_idx_Q.shape)]
    for _ in range(self.max_depth + 1):
      key = jnp.where(node >= 0, context_len + node, 0)
      lo.append(key)
      hi.append(jnp.where(node >= 0, key + 1, 0))
      node = jnp.where(node >= 0, jnp.take(parents, jnp.maximum(node, 0)), -1)
    return jnp.stack(lo, axis=-1), jnp.stack(hi, axis=-1)
