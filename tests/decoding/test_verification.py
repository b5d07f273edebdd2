"""Row-by-row rejection sampling from logits (CPU) against the all-rows rejection sampler."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspec.decoding import verification
from dspec.sampling import SamplingSpec, processed_probs

B, G, V = 6, 5, 64


@functools.partial(jax.jit, static_argnums=(0, 5))
def _both(spec, key, draft, num, logits, sampled_q):
  probs_fn = lambda x: processed_probs(x, spec, 0.8, 0.9)
  q = jax.nn.softmax(logits[:, :-1] * 0.5 + 1.0, axis=-1) if sampled_q else None
  eager = verification.rejection_verify(key, draft, num, q, probs_fn(logits))
  lazy = verification.rejection_verify_logits(key, draft, num, q, logits, probs_fn)
  return eager, lazy


@pytest.mark.slow
@pytest.mark.parametrize('sampled_q', [False, True])
@pytest.mark.parametrize('spec', [SamplingSpec(greedy=False),
                                  SamplingSpec(greedy=False, top_k=8, use_top_p=True),
                                  SamplingSpec(greedy=False, use_top_p=True)])
def test_row_by_row_equals_all_rows(spec, sampled_q):
  accepted = set()
  for seed in range(30):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(size=(B, G + 1, V)) * rng.choice([0.5, 8.0]), jnp.float32)
    greedy = np.argmax(np.asarray(logits[:, :G]), -1)
    # Drafts: the target's mode (often accepted) or a random token (often rejected).
    draft = np.where(rng.random((B, G)) < 0.9, greedy, rng.integers(0, V, (B, G)))
    num = np.where(rng.random(B) < 0.5, G, rng.integers(0, G + 1, B))   # some short
    num = jnp.asarray(num, jnp.int32)
    (n_e, out_e), (n_l, out_l) = _both(spec, jax.random.PRNGKey(seed),
                                       jnp.asarray(draft, jnp.int32), num, logits, sampled_q)
    np.testing.assert_array_equal(n_l, n_e)
    np.testing.assert_array_equal(out_l, out_e)
    accepted |= set(np.asarray(n_e).tolist())
  assert {0, G} <= accepted, 'rejections at the first draft and full acceptance both ran'


def test_no_drafts():
  spec = SamplingSpec(greedy=False)
  logits = jax.random.normal(jax.random.PRNGKey(0), (3, 1, V))
  draft, num = jnp.zeros((3, 0), jnp.int32), jnp.zeros((3,), jnp.int32)
  probs_fn = lambda x: processed_probs(x, spec, 1.0, 1.0)
  key = jax.random.PRNGKey(1)
  eager = verification.rejection_verify(key, draft, num, None, probs_fn(logits))
  lazy = verification.rejection_verify_logits(key, draft, num, None, logits, probs_fn)
  for a, b in zip(eager, lazy):
    np.testing.assert_array_equal(a, b)
