"""DSpark at T > 0: the drafts are samples of the Markov-biased distribution and that q is
what rejection sampling gets, so the output distribution is the target's (chi-square over
the joint of the first two tokens) for every Markov head variant, with per-row verify
lengths from the confidence head, and for beam trees over the Markov walk."""

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import generate
from lossless_checks import check_engine_samples_match_target
from dspec.decoding.drafters.dspark import DSparkDrafter
from dspec.decoding.engine import SpeculativeEngine
from dspec.decoding.prompts import pad_prompts
from dspec.decoding.tree_engine import TreeEngine
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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize('temperature', [0.0, 1.0])
def test_markov_trees_keep_the_target_distribution(small_vocab_model, temperature):
  """Beam trees over the Markov walk (each node's own token and recurrent state; sampled
  chains at T > 0): exact at T = 0 (greedy joint is the argmax point) and T = 1."""
  drafter, dparams = _random_drafter(small_vocab_model.cfg, 'rnn', seed=7)
  graphdef, params = nnx.split(small_vocab_model)
  spec = SamplingSpec(greedy=temperature == 0.0)
  engine = TreeEngine(SpeculativeEngine(graphdef, drafter=drafter, sampling=spec),
                      drafter.tree_proposer(3), num_nodes=7, max_depth=3)
  if temperature == 0.0:
    ar = SpeculativeEngine(graphdef)
    prompts = [PROMPT, PROMPT[:3], [7, 7, 2, 9, 1]]
    assert generate(engine, params, dparams, prompts, 12)[0] == \
        generate(ar, params, None, prompts, 12)[0]
    return
  check_engine_samples_match_target(engine, small_vocab_model, params, dparams, PROMPT,
                                    temperature=temperature, num_samples=20_000,
                                    num_tokens=2, max_new_tokens=2 + 7)   # whole trees


@pytest.mark.slow
def test_markov_tree_top_1_is_the_walk(small_vocab_model):
  """A beam of one is the greedy Markov walk, token for token (the recurrent state follows
  the path)."""
  drafter, dparams = _random_drafter(small_vocab_model.cfg, 'rnn', seed=5)
  graphdef, params = nnx.split(small_vocab_model)
  engine = SpeculativeEngine(graphdef, drafter=drafter)
  prompt_BP, lens = pad_prompts([PROMPT, PROMPT[:4]])
  state = engine.prefill(params, dparams, prompt_BP, lens, max_new_tokens=8)
  ctx, key = engine.context(state), jax.random.key(0)
  walk = drafter.propose(dparams, state.drafter_state, small_vocab_model, ctx, key)
  tree = drafter.tree_proposer(1).propose_tree(drafter, dparams, state.drafter_state,
                                               small_vocab_model, ctx, key, num_nodes=4)
  np.testing.assert_array_equal(tree.tokens_BN[:, 1:], walk.tokens_BG)
  wide = drafter.tree_proposer(3).propose_tree(drafter, dparams, state.drafter_state,
                                               small_vocab_model, ctx, key, num_nodes=10)
  assert int(wide.num_nodes_B.min()) == 10 and len(set(np.asarray(wide.parents_BN[0]))) > 4
