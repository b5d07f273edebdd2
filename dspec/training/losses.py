"""Token-level losses shared by the target, MTP and drafter objectives."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_cross_entropy(logits_BTV, labels_BT):
  """Per-token CE in fp32 without materialising one-hots."""
  logits = logits_BTV.astype(jnp.float32)
  logz = jax.nn.logsumexp(logits, axis=-1)
  gold = jnp.take_along_axis(logits, labels_BT[..., None], axis=-1)[..., 0]
  return logz - gold


def masked_mean(values, weights):
  """Weighted mean with a safe denominator."""
  weights = weights.astype(jnp.float32)
  return jnp.sum(values * weights) / jnp.maximum(jnp.sum(weights), 1e-6)
