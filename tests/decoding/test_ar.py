"""AR decoding: the baseline every speedup is measured against must itself be right."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import generate
from dspec.decoding.drafter import NoDrafter
from dspec.decoding.drafters.ngram import NgramDrafter
from dspec.decoding.engine import SpeculativeEngine
from dspec.decoding.prompts import generated_ids, pad_prompts
from dspec.decoding.state import Proposal
from dspec.sampling import SamplingSpec

PROMPTS = [[5, 6, 7, 8, 9, 10], [1, 2], [33, 4, 12]]


@functools.partial(nnx.jit)
def _last_logits(model, tokens):
  return model(tokens).logits_BTV[:, -1]


def _naive_greedy(model, prompt, n):
  seq = list(prompt)
  for _ in range(n):
    seq.append(int(jnp.argmax(_last_logits(model, jnp.asarray([seq]))[0])))
  return seq[len(prompt):]


@pytest.fixture(scope='module')
def ar_engine(tiny_split):
  return SpeculativeEngine(tiny_split[0])


@pytest.mark.slow
def test_greedy_matches_uncached_loop_for_ragged_batch(tiny_model, tiny_split, ar_engine):
  outs, state = generate(ar_engine, tiny_split[1], None, PROMPTS, 12)
  for prompt, out in zip(PROMPTS, outs):
    assert out == _naive_greedy(tiny_model, prompt, 12)
  # The prefill commits the first token; each of the 11 verify steps one more.
  assert np.all(np.asarray(state.stats.steps_B) == 11)
  assert np.all(np.asarray(state.stats.committed_B) == 11)


@pytest.mark.slow
def test_batch_rows_are_independent(tiny_split, ar_engine):
  batched, _ = generate(ar_engine, tiny_split[1], None, PROMPTS, 12)
  for i, prompt in enumerate(PROMPTS):
    alone, _ = generate(ar_engine, tiny_split[1], None, [prompt], 12)
    assert alone[0] == batched[i]


@pytest.mark.slow
def test_stop_token_ends_each_row_on_its_own(tiny_split, ar_engine):
  full, _ = generate(ar_engine, tiny_split[1], None, PROMPTS, 12)
  stop = full[0][3]
  first = full[1][0]   # a row whose very first token (the prefill's) is a stop token
  engine_first = SpeculativeEngine(tiny_split[0], stop_ids=(first,))
  outs, state = generate(engine_first, tiny_split[1], None, [PROMPTS[1]], 12)
  assert outs == [[first]] and int(state.stats.steps_B[0]) == 0
  engine = SpeculativeEngine(tiny_split[0], stop_ids=(stop,))
  outs, state = generate(engine, tiny_split[1], None, PROMPTS, 12)
  for ref, out in zip(full, outs):
    cut = ref.index(stop) + 1 if stop in ref else len(ref)
    assert out == ref[:cut]
  assert bool(np.all(np.asarray(state.done_B)))


@pytest.mark.slow
def test_sampling_is_seeded_and_respects_top_k(tiny_model, tiny_split):
  engine = SpeculativeEngine(tiny_split[0], sampling=SamplingSpec(greedy=False, top_k=3))
  prompt = [[5, 6, 7]] * 4
  a, _ = generate(engine, tiny_split[1], None, prompt, 10, temperature=1.0, seed=1)
  b, _ = generate(engine, tiny_split[1], None, prompt, 10, temperature=1.0, seed=1)
  c, _ = generate(engine, tiny_split[1], None, prompt, 10, temperature=1.0, seed=2)
  assert a == b and a != c
  # Every sampled token is among the top-3 of the target at its position.
  for row in a:
    seq = [5, 6, 7] + row
    logits = tiny_model(jnp.asarray([seq])).logits_BTV[0]
    for t, tok in enumerate(row):
      top3 = np.argsort(np.asarray(logits[2 + t]))[-3:]
      assert tok in top3


def test_sampling_spec_validation():
  with pytest.raises(ValueError, match='temperature'):
    SamplingSpec.create(-0.5, 0, 1.0)
  with pytest.raises(ValueError, match='top_p'):
    SamplingSpec.create(1.0, 0, 0.0)
  with pytest.raises(ValueError, match='top_p'):
    SamplingSpec.create(1.0, 0, 1.5)


@pytest.mark.slow
def test_chunks_of_a_seen_length_transfer_nothing(tiny_split, ar_engine):
  """`run`'s step limit and `force_wide` are device scalars transferred once per value
  (`device_scalar`): chunks of lengths already run transfer nothing to the device, and
  chunks of 4 + 4 + the rest commit what one call does."""
  params = tiny_split[1]
  prompt_BP, lens = pad_prompts(PROMPTS)
  start = lambda: ar_engine.prefill(params, None, prompt_BP, lens, max_new_tokens=12)
  expected = generated_ids(ar_engine.generate(params, None, ar_engine.run(params, None,
                                                                           start(), 4)))
  state = start()
  with jax.transfer_guard_host_to_device('disallow_explicit'):
    for limit in (4, 4, None):
      state = ar_engine.run(params, None, state, limit)
  assert generated_ids(state) == expected


@pytest.mark.slow
def test_an_ar_step_counts_as_a_step_proposing_nothing(tiny_split):
  """On a speculative engine's state (per-draft counters for γ = 3), plain AR steps (the
  controller's and the host loop's tier 0: no draft position, so no per-draft counting)
  leave the tokens and every counter as steps verifying an empty proposal do."""
  params = tiny_split[1]
  engine = SpeculativeEngine(tiny_split[0], drafter=NgramDrafter(num_draft=3))
  prompt_BP, lens = pad_prompts(PROMPTS)
  start = lambda: engine.prefill(params, None, prompt_BP, lens, max_new_tokens=6)
  empty = jax.device_put(Proposal(np.zeros((len(PROMPTS), 1), np.int32),
                                  np.zeros((len(PROMPTS),), np.int32)))
  stepped = start()
  for _ in range(3):
    stepped = engine.step(params, None, stepped, empty)
  ar = engine.with_drafter(NoDrafter()).run(params, None, start(), 3)
  assert np.asarray(ar.stats.accept_hist_BG1).shape == (len(PROMPTS), 4)
  assert generated_ids(ar) == generated_ids(stepped)
  for got, want in zip(jax.tree.leaves(ar.stats), jax.tree.leaves(stepped.stats)):
    np.testing.assert_array_equal(got, want)
