"""Statistical losslessness checks shared by every drafter's tests.

`check_engine_samples_match_target` runs a speculative engine on many copies of one prompt
and tests, with a chi-square test, that the joint distribution of the first `num_tokens`
generated tokens equals the target's own processed (temperature / top-k / top-p)
distribution, computed exactly by enumerating prefixes with the target model.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from scipy import stats

from dspec.sampling import processed_probs

MIN_EXPECTED = 5.0


def chi_square_pvalue(observed_counts, expected_probs) -> float:
  """Pearson chi-square p-value; cells with expected count < 5 are pooled into one."""
  observed = np.asarray(observed_counts, np.float64).ravel()
  expected = np.asarray(expected_probs, np.float64).ravel() * observed.sum()
  if np.any((expected == 0) & (observed > 0)):
    return 0.0   # a token the target gives zero mass was emitted: not lossless
  small = expected < MIN_EXPECTED
  obs = np.append(observed[~small], observed[small].sum())
  exp = np.append(expected[~small], expected[small].sum())
  keep = exp > 0
  obs, exp = obs[keep], exp[keep]
  return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


@functools.partial(nnx.jit, static_argnames=('spec',))
def _next_token_probs(model, seqs, spec, temperature, top_p):
  return processed_probs(model(seqs).logits_BTV[:, -1], spec, temperature, top_p)


def exact_joint(model, prompt, num_tokens, spec, temperature, top_p):
  """Exact probability of every sequence of `num_tokens` continuation tokens."""
  v = model.cfg.vocab_size
  joint = np.ones(1)
  for depth in range(num_tokens):
    prefixes = np.array(list(itertools.product(range(v), repeat=depth)),
                        np.int32).reshape(v ** depth, depth)
    seqs = np.concatenate([np.tile(np.asarray(prompt, np.int32), (len(prefixes), 1)),
                           prefixes], axis=1)
    probs = np.asarray(_next_token_probs(model, jnp.asarray(seqs), spec,
                                         jnp.float32(temperature), jnp.float32(top_p)),
                       np.float64)
    joint = (joint[:, None] * probs).reshape(-1)
  return joint.reshape([v] * num_tokens)


def sample_engine(engine, target_params, drafter_params, prompt, num_samples, num_tokens,
                  *, temperature, top_p=1.0, seed=0, max_new_tokens=None):
  """First `num_tokens` generated tokens of `num_samples` independent rows (a budget of
  `max_new_tokens`, default `num_tokens`: a tree engine needs room for whole trees, as it
  cuts a tree to the cache slots left)."""
  prompt_BP = np.tile(np.asarray(prompt, np.int32)[None], (num_samples, 1))
  lens = np.full((num_samples,), len(prompt), np.int32)
  state = engine.prefill(target_params, drafter_params, prompt_BP, lens,
                         temperature=temperature, top_p=top_p,
                         max_new_tokens=max_new_tokens or num_tokens, seed=seed)
  state = engine.generate(target_params, drafter_params, state)
  tokens = np.asarray(jax.device_get(state.tokens_BL))
  return tokens[:, len(prompt):len(prompt) + num_tokens]


def joint_counts(samples, vocab_size):
  counts = np.zeros([vocab_size] * samples.shape[1])
  np.add.at(counts, tuple(samples.T), 1)
  return counts


def check_engine_samples_match_target(engine, model, target_params, drafter_params, prompt,
                                      *, temperature, top_p=1.0, num_samples=60_000,
                                      num_tokens=2, seed=0, alpha=1e-3,
                                      max_new_tokens=None):
  """Asserts the engine's sampled joint distribution equals the target's (chi-square)."""
  samples = sample_engine(engine, target_params, drafter_params, prompt, num_samples,
                          num_tokens, temperature=temperature, top_p=top_p, seed=seed,
                          max_new_tokens=max_new_tokens)
  expected = exact_joint(model, prompt, num_tokens, engine.sampling, temperature, top_p)
  p_joint = chi_square_pvalue(joint_counts(samples, model.cfg.vocab_size), expected)
  p_first = chi_square_pvalue(joint_counts(samples[:, :1], model.cfg.vocab_size),
                              expected.sum(axis=tuple(range(1, num_tokens))))
  assert p_first > alpha and p_joint > alpha, (
      f'sampled output differs from the target: p(first)={p_first:.2e} '
      f'p(joint)={p_joint:.2e}')
  return p_first, p_joint
