"""Per-layer DFlash attention masks with z-lab's causal / sliding-window semantics.

z-lab's drafter (z-lab/dflash `dflash/model.py`) gives every draft layer a mask
over keys indexed by absolute position, the query of block slot i sitting at
`anchor + i`:

  causal          key position <= query position
  window W        query − key < W, and also key − query < W when not causal
  (neither)       everything visible (context < anchor and the whole block)

The window is per query: slot i sees context positions > anchor + i − W. dspec's own
drafters (DFlashConfig without `layer_types`) use an anchor-relative window instead
(context > anchor − W for the whole block, `anchor_window` here), as
`pallas_kernels.block_attention.DFlashDraftMask`/`DFlashTrainMask` do.

Both masks expose the written definition and ≤ 2 visible intervals per query row, so
they run on the 'xla' reference and the Pallas kernels alike.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import jax.numpy as jnp

from pallas_kernels.block_attention.masks import AttentionMask


def _check(window: Optional[int], name: str) -> None:
  if window is not None and window < 1:
    raise ValueError(f'{name} must be None or >= 1, got {window}')


def _block_range(i, causal: bool, window: Optional[int], block_len):
  """[lo, hi) of the block slots visible to slot i (before adding the key offset)."""
  lo = jnp.zeros_like(i) if window is None else jnp.maximum(i - window + 1, 0)
  if causal:
    hi = i + 1
  elif window is not None:
    hi = i + window
  else:
    hi = jnp.full_like(i, 1 << 30)
  return lo, jnp.minimum(hi, block_len)


def _context_lo(anchor, i, window: Optional[int], anchor_window: Optional[int]):
  """Smallest visible context position of slot i of the block anchored at `anchor`."""
  lo = jnp.zeros_like(anchor + i)
  if window is not None:
    lo = jnp.maximum(lo, anchor + i - window + 1)
  if anchor_window is not None:
    lo = jnp.maximum(lo, anchor - anchor_window + 1)
  return lo


@dataclasses.dataclass(frozen=True)
class DraftLayerMask(AttentionMask):
  """Drafting: Q = b block slots, KV = [context cache (C) | b block keys].

  Offsets per row: `context_len` (the anchor position; cache entries at kv < context_len
  are valid) and optionally `block_len` (only the first block_len block keys exist: the
  end-of-budget shrink of z-lab's loop), as `[batch]` or `[batch, 2]`.
  """

  block_size: int
  causal: bool = False
  window: Optional[int] = None
  anchor_window: Optional[int] = None
  cache_len: Optional[int] = None
  num_intervals: ClassVar[int] = 2

  def __post_init__(self):
    _check(self.window, 'window')
    _check(self.anchor_window, 'anchor_window')

  def resolve(self, q_len, kv_len):
    cache_len = kv_len - self.block_size
    if q_len != self.block_size or cache_len < 0 or self.cache_len not in (None, cache_len):
      raise ValueError(f'DraftLayerMask(B={self.block_size}) needs Q = B and KV = C + B; '
                       f'got Q={q_len}, KV={kv_len}')
    return dataclasses.replace(self, cache_len=cache_len)

  def prepare_offsets(self, offsets, batch, q_len):
    del q_len
    if offsets is None:
      raise ValueError('DraftLayerMask needs offsets = context_len [batch] or '
                       '(context_len, block_len) [batch, 2]')
    off = jnp.asarray(offsets, jnp.int32)
    if off.ndim <= 1:
      off = jnp.stack([jnp.broadcast_to(off.reshape(-1), (batch,)),
                       jnp.full((batch,), self.block_size, jnp.int32)], axis=-1)
    if off.shape[-1] != 2 or off.ndim != 2 or off.shape[0] not in (1, batch):
      raise ValueError(f'DraftLayerMask offsets must be [batch] or [batch, 2], got '
                       f'{off.shape}')
    return jnp.broadcast_to(off, (batch, 2))

  def __call__(self, q_idx, kv_idx, offsets):
    q_idx, kv_idx = jnp.broadcast_arrays(q_idx, kv_idx)
    c = self.cache_len
    anchor, block_len = offsets[0], offsets[1]
    ctx_lo = _context_lo(anchor, q_idx, self.window, self.anchor_window)
    context = (kv_idx < c) & (kv_idx < anchor) & (kv_idx >= ctx_lo)
    lo, hi = _block_range(q_idx, self.causal, self.window, block_len)
    j = kv_idx - c
    return context | ((kv_idx >= c) & (j >= lo) & (j < hi))

  def intervals(self, q_idx_Q, offsets):
    c = self.cache_len
    anchor, block_len = offsets[0], offsets[1]
    ctx_lo = _context_lo(anchor, q_idx_Q, self.window, self.anchor_window)
    ctx_hi = jnp.broadcast_to(jnp.minimum(anchor, c), q_idx_Q.shape)
    lo, hi = _block_range(q_idx_Q, self.causal, self.window, block_len)
    return (jnp.stack([ctx_lo, c + lo], axis=-1),
            jnp.stack([ctx_hi, c + jnp.maximum(hi, lo)], axis=-1))


@dataclasses.dataclass(frozen=True)
class TrainLayerMask(AttentionMask):
  """Training: Q = N blocks of B, KV = [S context | N·B block keys]; offsets = anchors
  [batch, N] (anchor < 0: a padded block that sees nothing). Block n's slot i sees context
  kv < anchor_n (window/anchor_window as in `DraftLayerMask`) and the keys of its own block
  allowed by `causal` / `window`; never other blocks."""

  block_size: int
  context_len: int
  causal: bool = False
  window: Optional[int] = None
  anchor_window: Optional[int] = None
  num_intervals: ClassVar[int] = 2

  def __post_init__(self):
    _check(self.window, 'window')
    _check(self.anchor_window, 'anchor_window')

  def resolve(self, q_len, kv_len):
    if q_len % self.block_size or kv_len != self.context_len + q_len:
      raise ValueError(f'TrainLayerMask(B={self.block_size}, S={self.context_len}) needs '
                       f'Q = N*B and KV = S + Q; got Q={q_len}, KV={kv_len}')
    return self

  def prepare_offsets(self, offsets, batch, q_len):
    if offsets is None:
      raise ValueError('TrainLayerMask needs offsets = anchors [batch, N]')
    anchors = jnp.asarray(offsets, jnp.int32)
    anchors = anchors[None] if anchors.ndim == 1 else anchors
    n = q_len // self.block_size
    if anchors.ndim != 2 or anchors.shape[1] != n or anchors.shape[0] not in (1, batch):
      raise ValueError(f'anchors must have shape [{batch}, {n}], got {anchors.shape}')
    return jnp.broadcast_to(anchors, (batch, n))

  def max_kv_tiles(self, q_len, kv_len, block_q, block_kv):
    # Context tiles, plus the own-block keys of one q tile's rows (a range of at most
    # block_q + 2 (B − 1) keys), as `DFlashTrainMask`.
    own_keys = block_q + 2 * (self.block_size - 1)
    bound = -(-self.context_len // block_kv) + -(-own_keys // block_kv) + 1
    return min(bound, -(-kv_len // block_kv))

  def _rows(self, q_idx, anchors_N):
    block = q_idx // self.block_size
    return block, q_idx % self.block_size, jnp.take(anchors_N, block, mode='clip')

  def __call__(self, q_idx, kv_idx, offsets):
    q_idx, kv_idx = jnp.broadcast_arrays(q_idx, kv_idx)
    block, i, anchor = self._rows(q_idx, offsets)
    s, big_b = self.context_len, self.block_size
    ctx_lo = _context_lo(anchor, i, self.window, self.anchor_window)
    context = (kv_idx < s) & (kv_idx < anchor) & (kv_idx >= ctx_lo)
    lo, hi = _block_range(i, self.causal, self.window, big_b)
    j = kv_idx - s - block * big_b
    own = (kv_idx >= s) & (j >= lo) & (j < hi)
    return (anchor >= 0) & (context | own)

  def intervals(self, q_idx_Q, offsets):
    block, i, anchor = self._rows(q_idx_Q, offsets)
    s, big_b = self.context_len, self.block_size
    ctx_lo = _context_lo(anchor, i, self.window, self.anchor_window)
    ctx_hi = jnp.minimum(anchor, s)
    lo, hi = _block_range(i, self.causal, self.window, big_b)
    base = s + block * big_b
    lo_QI = jnp.stack([ctx_lo, base + lo], axis=-1)
    hi_QI = jnp.stack([ctx_hi, base + jnp.maximum(hi, lo)], axis=-1)
    valid = (anchor >= 0)[:, None]
    return jnp.where(valid, lo_QI, 0), jnp.where(valid, hi_QI, 0)
