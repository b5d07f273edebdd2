"""Frozen configuration of the target transformer (Llama / Qwen3 family)."""

from __future__ import annotations

import dataclasses
import numbers



class DictConfig:
  """`to_dict` / `from_dict` for frozen config dataclasses; unknown keys are an error."""

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict):
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - fields
    if unknown:
      raise ValueError(f'unknown {cls.__name__} keys: {sorted(unknown)}')
    return cls(**d)


@dataclasses.dataclass(frozen=True)
class TransformerConfig(DictConfig):
  """Static shape and numerics of a Llama/Qwen3-style decoder.

  Hashable, so it can sit inside static jit arguments.
  """

  vocab_size: int
  num_layers: int
  embed_dim: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  qk_norm: bool = False          # Qwen3 per-head RMSNorm on q and k.
  tie_embeddings: bool = False
  dtype: str = 'float32'         # compute dtype (a numpy dtype name)
  param_dtype: str = 'float32'   # dtype params are kept in

  def __post_init__(self):
    for name in ('vocab_size', 'num_layers', 'embed_dim', 'num_heads',
                 'num_kv_heads', 'head_dim', 'mlp_dim'):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f'{name} must be a positive integer, got {value!r}')
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f'num_heads={self.num_heads} is not a multiple of '
          f'num_kv_heads={self.num_kv_heads}')

  def num_params(self) -> int:
    """Parameter count (embedding counted once when tied)."""
    d, f, l = self.embed_dim, self.mlp_dim, self.num_layers
    attn = d * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
    per_layer = attn + 3 * d * f + 2 * d
    if self.qk_norm:
      per_layer += 2 * self.head_dim
    head = 0 if self.tie_embeddings else self.vocab_size * d
    return self.vocab_size * d + l * per_layer + d + head

