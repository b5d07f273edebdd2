"""Static-shape KV cache with per-sequence lengths.

Rollback after a rejected draft is `with_lengths(shorter)`: stale entries past a row's
length are never attended (the mask is by position) and are overwritten by the next write.
"""

from __future__ import annotations

from typing import ClassVar

import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
  """Keys/values `[layers, batch, max_len, kv_heads, head_dim]` plus `lengths_B`."""

  k_LBSKD: jnp.ndarray
  v_LBSKD: jnp.ndarray
  lengths_B: jnp.ndarray   # int32: number of valid positions per sequence.

  # Logical axes of each field (`dspec.sharding`: mesh placement, row refills).
  LOGICAL_AXES: ClassVar[dict] = {
      'k_LBSKD': ('layers', 'batch', 'cache_len', 'kv_heads', 'head_dim'),
      'v_LBSKD': ('layers', 'batch', 'cache_len', 'kv_heads', 'head_dim'),
      'lengths_B': ('batch',)}

  @classmethod
  def zeros(cls, num_layers, batch, max_len, num_kv_heads, head_dim, dtype=jnp.float32):
    shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
               jnp.zeros((batch,), jnp.int32))

  @classmethod
  def for_model(cls, cfg, num_layers: int, batch: int, max_len: int) -> 'KVCache':
    """Zeros shaped for a model config's KV heads, head size and compute dtype."""
    return cls.zeros(num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)

  @property
  def max_len(self) -> int:
    return self.k_LBSKD.shape[2]

  def write(self, layer: int, k_BTKD, v_BTKD, positions_BT) -> 'KVCache':
    """Writes new keys/values of one layer at absolute positions (out of range: dropped)."""
    batch_idx = jnp.arange(k_BTKD.shape[0])[:, None]
    k = self.k_LBSKD.at[layer, batch_idx, positions_BT].set(
        k_BTKD.astype(self.k_LBSKD.dtype), mode='drop')
    v = self.v_LBSKD.at[layer, batch_idx, positions_BT].set(
        v_BTKD.astype(self.v_LBSKD.dtype), mode='drop')
    return self.replace(k_LBSKD=k, v_LBSKD=v)

  def with_lengths(self, lengths_B) -> 'KVCache':
    return self.replace(lengths_B=lengths_B.astype(jnp.int32))
