"""`processed_probs` against the full-sort definition of top-k / top-p it replaces."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from unittest import mock

from dspec import sampling
from dspec.decoding import verification
from dspec.sampling import SamplingSpec, processed_probs


def _sorted_reference(logits, spec, temperature, top_p):
  """The previous implementation: sort the whole vocabulary for top-p."""
  logits = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
  vocab = logits.shape[-1]
  if spec.top_k and spec.top_k < vocab:
    kth = jax.lax.top_k(logits, spec.top_k)[0][..., -1:]
    logits = jnp.where(logits >= kth, logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  if spec.use_top_p:
    sorted_probs = jnp.sort(probs, axis=-1)[..., ::-1]
    cum_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    kept = cum_before < top_p
    threshold = jnp.min(jnp.where(kept, sorted_probs, jnp.inf), axis=-1, keepdims=True)
    probs = jnp.where(probs >= threshold, probs, 0.0)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
  return probs


@functools.partial(jax.jit, static_argnums=(1, 4))
def _both(logits, spec, temperature, top_p, plan):
  with mock.patch.object(sampling, '_search_plan', lambda: plan):
    new = processed_probs(logits, spec, temperature, top_p)
  return new, _sorted_reference(logits, spec, temperature, top_p)


def _logits(seed, shape, kind):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=shape)
  if kind == 'peaked':      # nucleus inside the top-k head
    x = x * 6.0
  elif kind == 'flat':      # nucleus of hundreds of tokens: exact search
    x = x * 0.3
  elif kind == 'ties':      # few distinct values: ties at the cut
    x = np.round(x * 2.0) / 2.0
  elif kind == 'mixed':     # peaked and flat rows in one batch
    x = x * np.where(rng.random(shape[:-1] + (1,)) < 0.5, 6.0, 0.3)
  elif kind == 'zipf':      # LM-like: log-probabilities ~ -1.1 log(rank), shuffled
    ranks = np.argsort(rng.random(shape), axis=-1) + 1
    x = -1.1 * np.log(ranks) + 0.05 * x
  return jnp.asarray(x, jnp.float32)


def _mass_before(probs):
  """Float64 mass and count of the tokens strictly more probable than each token."""
  flat = probs.reshape(-1, probs.shape[-1]).astype(np.float64)
  mass, count = np.empty_like(flat), np.empty_like(flat)
  for r, row in enumerate(flat):
    desc = np.sort(row)[::-1]
    count[r] = np.searchsorted(-desc, -row, side='left')
    mass[r] = np.concatenate([[0.0], np.cumsum(desc)[:-1]])[count[r].astype(int)]
  return mass.reshape(probs.shape), count.reshape(probs.shape)


def _check(logits, spec, temperature, top_p, plan=(True, 1)):
  """New == old == the exact (float64) cut, except tokens whose preceding mass is within
  float32 summation error of top_p, where the two summation orders may differ."""
  new, ref = map(np.asarray, _both(logits, spec, temperature, top_p, plan))
  plain = np.asarray(processed_probs(logits, dataclasses.replace(spec, use_top_p=False),
                                     temperature, top_p))
  before, count = _mass_before(plain)
  # Worst-case float32 error of summing `count` terms to about top_p, in any order.
  clear = np.abs(before - top_p) > (count + 1) * 2 ** -23 * top_p
  np.testing.assert_array_equal((new > 0)[clear], (ref > 0)[clear])
  if spec.use_top_p:
    np.testing.assert_array_equal((new > 0)[clear], ((before < top_p) & (plain > 0))[clear])
  assert np.all(np.sum(np.where(clear, 0.0, plain), -1) < 1e-2), 'rounding zone is small'
  np.testing.assert_allclose(new, ref, rtol=1e-4, atol=1e-4 * top_p)
  np.testing.assert_allclose(new.sum(-1), 1.0, rtol=1e-5)


# (row by row, probes per pass): the CPU plan, batched bisection, the accelerator plan.
@pytest.mark.slow
@pytest.mark.parametrize('plan', [(True, 1), (False, 1), (False, 4), (False, 15)])
@pytest.mark.parametrize('kind', ['peaked', 'flat', 'ties', 'mixed', 'zipf'])
def test_top_p_matches_sort(kind, plan):
  spec = SamplingSpec(greedy=False, top_k=0, use_top_p=True)
  for seed in range(3):
    logits = _logits(seed, (3, 5, 1024), kind)
    for top_p in (1e-6, 0.05, 0.5, 0.9, 0.95, 0.999, 0.999999):
      for temperature in (0.7, 1.0):
        _check(logits, spec, temperature, top_p, plan)


@pytest.mark.slow
@pytest.mark.parametrize('top_k', [1, 5, 40, 1023])
@pytest.mark.parametrize('kind', ['flat', 'ties', 'zipf'])
def test_top_k_and_top_p_match_sort(top_k, kind):
  logits = _logits(7, (3, 5, 1024), kind)
  for use_top_p in (False, True):
    spec = SamplingSpec(greedy=False, top_k=top_k, use_top_p=use_top_p)
    for top_p in (1e-6, 0.5, 0.95, 0.999999):
      _check(logits, spec, 1.0, top_p)


@pytest.mark.slow
def test_small_vocab_and_exact_ties():
  spec = SamplingSpec(greedy=False, top_k=0, use_top_p=True)
  _check(_logits(0, (4, 16), 'ties'), spec, 1.0, 0.7)   # vocab <= head: no search
  # Four equal tokens, cut after the second: every tie of the last kept one stays.
  uniform = jnp.zeros((1, 4))
  probs = processed_probs(uniform, spec, 1.0, 0.5)
  np.testing.assert_allclose(probs, np.full((1, 4), 0.25))


@pytest.mark.slow
def test_search_agrees_with_sort_on_full_vocab():
  """Demo-sized rows (vocab 8192) through the bisection, each row a different shape."""
  spec = SamplingSpec(greedy=False, top_k=0, use_top_p=True)
  logits = jnp.concatenate([_logits(s, (1, 8, 8192), k) for s, k in
                            enumerate(['zipf', 'flat', 'ties', 'mixed'])])
  for top_p in (0.5, 0.9, 0.95, 0.99):
    _check(logits, spec, 1.0, top_p)
  new = processed_probs(logits, spec, 1.0, 0.95)
  assert int(jnp.max(jnp.sum(new > 0, -1))) > 1000, 'a wide nucleus'


@pytest.mark.parametrize('top_k,use_top_p', [(0, True), (50, False), (50, True)])
def test_no_full_vocabulary_sort(top_k, use_top_p):
  spec = SamplingSpec(greedy=False, top_k=top_k, use_top_p=use_top_p)
  fn = jax.jit(lambda x: processed_probs(x, spec, 0.7, 0.9))
  hlo = fn.lower(jnp.zeros((2, 3, 1024))).compile().as_text()
  assert ' sort(' not in hlo


def test_top_k_helper_survives_slicing():
  """`sampling.top_k` equals `jax.lax.top_k`, and slicing its indices (which turns the bare
  op into a full sort) keeps XLA's TopK."""
  x = _logits(4, (3, 512), 'mixed')
  vals, idx = sampling.top_k(x, 8)
  want_vals, want_idx = jax.lax.top_k(x, 8)
  np.testing.assert_array_equal(idx, want_idx)
  np.testing.assert_array_equal(vals, want_vals)
  fn = jax.jit(lambda x: sampling.top_k(x, 8)[1].at[:, -1].set(0))
  assert ' sort(' not in fn.lower(x).compile().as_text()


def test_first_argmax_matches_argmax_with_ties():
  logits = _logits(3, (4, 5, 256), 'ties')
  np.testing.assert_array_equal(verification.first_argmax(logits), jnp.argmax(logits, -1))
  assert int(verification.first_argmax(jnp.full((1, 8), -jnp.inf))[0]) == 0
