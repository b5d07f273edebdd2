"""DSpark at T > 0: the drafts are samples of the Markov-biased distribution and that q is
what rejection sampling gets, so the output distribution is the target's (chi-square over
the joint of the first two tokens) for every Markov head variant, with per-row verify
lengths from the confidence head."""

import jax
import numpy as np
import pytest
from flax import nnx

from lossless_checks import check_engine_samples_match_target
from dspec.decoding.drafters.dspark import DSparkDrafter
from dspec.decoding.engine import SpeculativeEngine
from dspec.sampling import SamplingSpec
from dspec.models import dspark

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def _random_drafter(target_cfg, head_type: str, seed: int):
  """A random DSpark drafter whose Markov bias and confidences are far from trivial."""
  cfg = dspark.DSparkConfig.create(target_cfg.num_layers, num_layers=1, block_size=3,
                                   mask_token_id=11, markov_rank=4, markov_head_type=head_type)
  model = dspark.DSparkModel(cfg, target_cfg, rngs=nnx.Rngs(seed))
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  head = model.markov_head
  head.markov_w1.weight[...] = jax.random.normal(k1, head.markov_w1.weight.shape)
  head.markov_w2.kernel[...] = 2.0 * jax.random.normal(k2, head.markov_w2.kernel.shape)
  proj = model.confidence_head.proj.kernel
  proj[...] = 3.0 * jax.random.normal(k3, proj.shape)
  return DSparkDrafter.create(model, verify_cost=0.1)


@pytest.mark.parametrize('head_type,spec,temperature', [
    ('vanilla', SamplingSpec(greedy=False), 1.0),
    ('gated', SamplingSpec(greedy=False, top_k=5), 0.8),
    ('rnn', SamplingSpec(greedy=False), 1.0),
])
def test_sampled_output_matches_the_target(small_vocab_model, head_type, spec, temperature):
  drafter, dparams = _random_drafter(small_vocab_model.cfg, head_type, seed=7)
  graphdef, params = nnx.split(small_vocab_model)
  engine = SpeculativeEngine(graphdef, drafter=drafter, sampling=spec)
  check_engine_samples_match_target(engine, small_vocab_model, params, dparams, PROMPT,
                                    temperature=temperature, num_samples=20_000,
                                    num_tokens=2)


def test_sampled_walk_follows_the_biased_q(small_vocab_model):
  """Each drafted token is a draw of the q handed to rejection sampling (checked on slot
  1, whose q depends on the slot-0 draw through the Markov head)."""
  drafter, dparams = _random_drafter(small_vocab_model.cfg, 'rnn', seed=3)
  model = nnx.merge(drafter.graphdef, dparams)
  n = 20_000
  hidden = jax.random.normal(jax.random.key(1), (1, 3, small_vocab_model.cfg.embed_dim))
  hidden = jax.numpy.broadcast_to(hidden, (n, 3, hidden.shape[-1]))
  walk = jax.jit(lambda h, k: model.walk(small_vocab_model, h, jax.numpy.full((n,), 4),
                                         sampling=SamplingSpec(greedy=False),
                                         temperature=1.0, top_p=1.0, key=k))(
                                             hidden, jax.random.key(2))
  tokens, q = np.asarray(walk.tokens_BG), np.asarray(walk.q_BGV)
  first = tokens[:, 0] == np.bincount(tokens[:, 0]).argmax()
  freq = np.bincount(tokens[first, 1], minlength=q.shape[-1]) / first.sum()
  np.testing.assert_allclose(freq, q[first][0, 1], atol=0.03)
  assert np.abs(q[first][0, 1] - q[~first][0, 1]).max() > 0.05   # q depends on slot 0
