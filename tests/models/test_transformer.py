"""The cache invariant every verifier relies on: cached logits == full forward logits."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspec.models.config import TransformerConfig
from dspec.models.transformer import Transformer


@functools.partial(nnx.jit, static_argnames=('taps',))
def forward(model, tokens, cache=None, taps=()):
  return model(tokens, cache=cache, taps=taps)


@pytest.fixture(scope='module')
def model():
  cfg = TransformerConfig(vocab_size=97, num_layers=3, embed_dim=48, num_heads=6,
                          num_kv_heads=2, head_dim=8, mlp_dim=96, qk_norm=True,
                          tie_embeddings=True, rope_theta=1e4)
  return Transformer(cfg, rngs=nnx.Rngs(1))


@pytest.mark.slow
def test_cached_steps_match_full_forward(model):
  """Prefill, then multi-token and single-token steps at per-row offsets, vs one pass."""
  b, t = 3, 21
  tokens = jax.random.randint(jax.random.key(0), (b, t), 0, model.cfg.vocab_size)
  full = forward(model, tokens, taps=(0, 2))
  # Rows start at different offsets: row r is prefilled with r + 2 tokens.
  starts = np.array([2, 3, 4])
  cache = model.init_cache(b, 32)
  out = forward(model, tokens[:, :4], cache)
  cache = out.cache.with_lengths(jnp.asarray(starts))
  pos = starts.copy()
  for step_len in (5, 1, 3, 1, 4):
    idx = pos[:, None] + np.arange(step_len)[None, :]
    step_tokens = jnp.take_along_axis(tokens, jnp.asarray(idx), axis=1)
    out = forward(model, step_tokens, cache, taps=(0, 2))
    want = np.take_along_axis(np.asarray(full.logits_BTV), idx[..., None], axis=1)
    np.testing.assert_allclose(out.logits_BTV, want, atol=1e-5, rtol=1e-5)
    want_taps = np.take_along_axis(np.asarray(full.taps_BTND), idx[..., None, None], axis=1)
    np.testing.assert_allclose(out.taps_BTND, want_taps, atol=1e-5, rtol=1e-5)
    pos += step_len
    cache = out.cache.with_lengths(jnp.asarray(pos))


@pytest.mark.slow
def test_rollback_rewinds_lengths_only(model):
  """Writing rejected tokens then rewinding gives the same logits as never writing them."""
  tokens = jax.random.randint(jax.random.key(2), (1, 12), 0, model.cfg.vocab_size)
  full = forward(model, tokens).logits_BTV
  cache = model.init_cache(1, 16)
  cache = forward(model, tokens[:, :6], cache).cache.with_lengths(jnp.array([6]))
  junk = jnp.full((1, 5), 7, jnp.int32)
  cache = forward(model, junk, cache).cache      # rejected draft: lengths stay at 6
  out = forward(model, tokens[:, 6:12], cache)
  np.testing.assert_allclose(out.logits_BTV, full[:, 6:12], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_taps_are_residual_outputs_and_hidden_is_post_norm(model):
  tokens = jnp.arange(10)[None, :] % model.cfg.vocab_size
  out = forward(model, tokens, taps=(2,))
  np.testing.assert_allclose(model.norm(out.taps_BTND[:, :, 0]), out.hidden_BTD,
                             atol=1e-6)
  with pytest.raises(ValueError, match='out of range'):
    model(tokens, taps=(3,))


def test_config_rejects_bad_gqa():
  with pytest.raises(ValueError, match='multiple'):
    TransformerConfig(vocab_size=8, num_layers=1, embed_dim=8, num_heads=3,
                      num_kv_heads=2, head_dim=4, mlp_dim=8)
