"""Logit processing (temperature, top-k, top-p) shared by AR sampling and verification.

Target rows, bonus rows and sampled draft rows all go through `processed_probs`, so the
speculative output distribution is exactly the one plain sampling would give.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
  """Static sampling knobs (hashable; part of the compiled program).

  greedy: argmax decoding (temperature 0). top_k: 0 disables. use_top_p: whether the
  runtime `top_p` array is applied (kept static so greedy/plain sampling skip the sort).
  """

  greedy: bool = True
  top_k: int = 0
  use_top_p: bool = False

  @classmethod
  def create(cls, temperature: float, top_k: int, top_p: float) -> 'SamplingSpec':
    if temperature < 0:
      raise ValueError(f'temperature must be >= 0, got {temperature}')
    if not 0.0 < top_p <= 1.0:
      raise ValueError(f'top_p must be in (0, 1], got {top_p}')
    if top_k < 0:
      raise ValueError(f'top_k must be >= 0, got {top_k}')
    return cls(greedy=temperature == 0, top_k=int(top_k), use_top_p=top_p < 1.0)


def processed_probs(logits_NV, spec: SamplingSpec, temperature, top_p):
  """Probabilities after temperature, top-k and top-p (fp32). Not used when greedy."""
  logits = logits_NV.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
  vocab = logits.shape[-1]
  if spec.top_k and spec.top_k < vocab:
    kth = jax.lax.top_k(logits, spec.top_k)[0][..., -1:]
    logits = jnp.where(logits >= kth, logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  if spec.use_top_p:
    sorted_probs = jnp.sort(probs, axis=-1)[..., ::-1]
    cum_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    # Keep the smallest prefix whose mass reaches top_p: tokens whose preceding mass < top_p.
    kept = cum_before < top_p
    threshold = jnp.min(jnp.where(kept, sorted_probs, jnp.inf), axis=-1, keepdims=True)
    probs = jnp.where(probs >= threshold, probs, 0.0)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
  return probs


def sample_from_probs(key, probs_NV):
  """One categorical sample per row; zero-probability tokens are never drawn."""
  logp = jnp.where(probs_NV > 0, jnp.log(jnp.maximum(probs_NV, 1e-38)), -jnp.inf)
  return jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)
