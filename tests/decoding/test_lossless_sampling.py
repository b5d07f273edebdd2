"""Sampled losslessness: speculative sampling reproduces the target distribution exactly.

Two levels: (1) the rejection sampler alone on a toy Markov target/draft pair with explicit
transition matrices, chi-square over 100k samples of the first token and of the joint of
three consecutive tokens, including adversarial drafts and a deliberately broken rule that
the test must catch; (2) the whole engine on a 12-token transformer, every drafter.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspec.decoding.controller import ControllerConfig, CostTable, VerifyLengthController
from dspec.decoding.drafters.ngram import NgramDrafter
from dspec.decoding.drafters.oracle import OracleDrafter
from dspec.decoding.drafters.self_draft import SelfDrafter
from dspec.decoding.engine import SpeculativeEngine
from dspec.decoding.tree_engine import TreeConfig
from dspec.sampling import SamplingSpec, processed_probs, sample_from_probs
from dspec.decoding.verification import rejection_verify
from lossless_checks import check_engine_samples_match_target, chi_square_pvalue, joint_counts
from flax import nnx

V, G, N = 8, 3, 100_000
ALPHA = 1e-3


def _markov(key, peak):
  logits = jax.random.normal(key, (V, V)) * peak
  return jax.nn.softmax(logits, axis=-1)


def _broken_verify(key, draft_BG, num_proposed_B, q_BGV, p_BG1V):
  """Accepts with min(1, p/q) but resamples rejections from p instead of max(p - q, 0)."""
  b, g = draft_BG.shape
  key_u, key_x = jax.random.split(key)
  p_d = jnp.take_along_axis(p_BG1V[:, :g], draft_BG[..., None], axis=-1)[..., 0]
  q_d = jnp.take_along_axis(q_BGV, draft_BG[..., None], axis=-1)[..., 0]
  ok = jax.random.uniform(key_u, (b, g)) * q_d < p_d
  n_B = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1)
  corrected = sample_from_probs(key_x, p_BG1V[jnp.arange(b), n_B])
  j = jnp.arange(g + 1)[None, :]
  padded = jnp.concatenate([draft_BG, jnp.zeros((b, 1), jnp.int32)], axis=1)
  return n_B, jnp.where(j < n_B[:, None], padded, corrected[:, None])


@functools.partial(jax.jit, static_argnames=('verify', 'one_hot_draft'))
def _simulate(key, P_VV, Q_VV, verify, one_hot_draft):
  """N independent chains from anchor 0: speculative steps until 3 tokens are emitted."""
  out = jnp.zeros((N, 3 + G + 1), jnp.int32)
  count = jnp.zeros((N,), jnp.int32)
  anchor = jnp.zeros((N,), jnp.int32)
  for step in range(3):
    k_draft, k_verify = jax.random.split(jax.random.fold_in(key, step))
    drafts, qs, prev = [], [], anchor
    for j in range(G):
      q = Q_VV[prev]
      d = (jnp.argmax(q, axis=-1).astype(jnp.int32) if one_hot_draft
           else sample_from_probs(jax.random.fold_in(k_draft, j), q))
      drafts.append(d)
      qs.append(jax.nn.one_hot(d, V) if one_hot_draft else q)
      prev = d
    draft_NG = jnp.stack(drafts, axis=1)
    context = jnp.concatenate([anchor[:, None], draft_NG], axis=1)
    p_NG1V = P_VV[context]
    q_NGV = None if (one_hot_draft and verify is rejection_verify) else jnp.stack(qs, 1)
    n, emitted = verify(k_verify, draft_NG, jnp.full((N,), G, jnp.int32), q_NGV, p_NG1V)
    rows = jnp.arange(N)[:, None]
    pos = jnp.where(jnp.arange(G + 1)[None, :] <= n[:, None],
                    count[:, None] + jnp.arange(G + 1)[None, :], out.shape[1])
    out = out.at[rows, pos].set(emitted, mode='drop')
    count = count + n + 1
    anchor = emitted[jnp.arange(N), n]
  return out[:, :3]



def _pvalues(samples, P):
  P = np.asarray(P, np.float64)
  joint = P[0][:, None, None] * P[:, :, None] * P[None, :, :]
  return (chi_square_pvalue(joint_counts(samples[:, :1], V), P[0]),
          chi_square_pvalue(joint_counts(samples, V), joint))


def _cases():
  k = jax.random.split(jax.random.key(0), 8)
  P = _markov(k[0], 1.5)
  far = jax.nn.softmax(-5.0 * jnp.log(P + 1e-3), axis=-1)            # mass where p is small
  holes = P.at[:, :3].set(0.0)
  holes = holes / holes.sum(-1, keepdims=True)                        # q = 0 where p > 0
  P_sparse = P.at[:, 5:].set(0.0)
  P_sparse = P_sparse / P_sparse.sum(-1, keepdims=True)
  Q_outside = jax.nn.one_hot(jnp.full((V,), 7), V)                     # one-hot where p = 0
  logits = jax.random.normal(k[1], (V, V)) * 2.0
  P_topk = processed_probs(logits, SamplingSpec(greedy=False, top_k=3), 0.8, 1.0)
  P_topp = processed_probs(logits, SamplingSpec(greedy=False, use_top_p=True), 1.3, 0.7)
  return {
      'random': (P, _markov(k[2], 1.5), False),
      'q_far_from_p': (P, far, False),
      'q_zero_where_p_positive': (P, holes, False),
      'q_equals_p': (P, P, False),
      'one_hot_q_on_zero_p_token': (P_sparse, Q_outside, True),
      'argmax_draft': (P, _markov(k[3], 1.5), True),
      'top_k_processed_target': (P_topk, _markov(k[4], 1.0), False),
      'top_p_processed_target': (P_topp, _markov(k[5], 1.0), False),
  }


@pytest.mark.slow
@pytest.mark.parametrize('case', list(_cases()))
def test_rejection_sampling_matches_target_joint(case):
  P, Q, one_hot = _cases()[case]
  samples = np.asarray(_simulate(jax.random.key(7), P, Q, rejection_verify, one_hot))
  p_first, p_joint = _pvalues(samples, P)
  assert p_first > ALPHA and p_joint > ALPHA, (p_first, p_joint)


def test_broken_acceptance_rule_is_caught():
  P, Q, _ = _cases()['q_far_from_p']
  samples = np.asarray(_simulate(jax.random.key(7), P, Q, _broken_verify, False))
  p_first, p_joint = _pvalues(samples, P)
  assert min(p_first, p_joint) < 1e-12


@pytest.mark.slow
def test_accept_probability_and_residual_are_exact():
  """One position: P(accept d) = min(1, p(d)/q(d)); rejected output ~ norm(max(p-q, 0))."""
  p = jnp.array([0.5, 0.3, 0.2, 0.0])
  q = jnp.array([0.1, 0.6, 0.1, 0.2])
  n = 200_000
  key = jax.random.key(3)
  draft = sample_from_probs(key, jnp.tile(q, (n, 1)))[:, None]
  p_b = jnp.tile(p, (n, 2, 1))
  num, out = rejection_verify(jax.random.key(4), draft, jnp.ones((n,), jnp.int32),
                              jnp.tile(q, (n, 1, 1)), p_b)
  draft, num, out = map(np.asarray, (draft[:, 0], num, out))
  for tok in range(4):
    sel = draft == tok
    want = min(1.0, float(p[tok] / q[tok]))
    assert abs(num[sel].mean() - want) < 0.01
  residual = np.maximum(np.asarray(p - q), 0)
  residual /= residual.sum()
  rejected_out = out[num == 0, 0]
  freq = np.bincount(rejected_out, minlength=4) / len(rejected_out)
  np.testing.assert_allclose(freq, residual, atol=0.01)


# ------------------------------------------------------------------ whole engine, T > 0

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]


@pytest.mark.slow
@pytest.mark.parametrize('name,drafter,spec,temperature,top_p', [
    ('ar', None, SamplingSpec(greedy=False), 1.0, 1.0),
    ('ngram', NgramDrafter(num_draft=3, max_n=2), SamplingSpec(greedy=False), 1.0, 1.0),
    ('self', SelfDrafter(num_draft=2), SamplingSpec(greedy=False, top_k=4), 0.7, 1.0),
    ('oracle_adversarial', OracleDrafter(num_draft=3, acceptance=(0.0,)),
     SamplingSpec(greedy=False, use_top_p=True), 1.0, 0.8),
])
def test_engine_sampling_is_lossless(small_vocab_model, name, drafter, spec, temperature,
                                     top_p):
  graphdef, params = nnx.split(small_vocab_model)
  kw = {} if drafter is None else {'drafter': drafter}
  engine = SpeculativeEngine(graphdef, sampling=spec, **kw)
  # oracle_adversarial proposes greedy + 1 at every slot: a wrong token, often one the
  # top-p target gives no mass.
  check_engine_samples_match_target(engine, small_vocab_model, params, None, PROMPT,
                                    temperature=temperature, top_p=top_p,
                                    num_samples=40_000, num_tokens=2)


# ------------------------------------------------- the controller switching tiers, T > 0

class _ScheduledController(VerifyLengthController):
  """The controller with its decisions replaced by a fixed cycle of tiers (one step per
  chunk, no shadow drafts), so every generation switches tiers mid-way whatever the
  scores say."""

  def __init__(self, *args, schedule, **kwargs):
    super().__init__(*args, **kwargs)
    self.schedule, self.chosen = schedule, []

  def decide(self, estimate, policy):
    g = self.schedule[len(self.chosen) % len(self.schedule)]
    self.chosen.append(g)
    decision = super().decide(estimate, policy)
    return dataclasses.replace(decision, tier=g, chunk=1, probe=False, shadow=False,
                               plain_ar=False,
                               state=dataclasses.replace(decision.state, prev=g, chunk=1))


@pytest.mark.slow
@pytest.mark.parametrize('name,drafter,schedule', [
    ('self', SelfDrafter(num_draft=2), (0, 2, 0)),
    ('oracle_adversarial', OracleDrafter(num_draft=2, acceptance=(0.0,)), (0, 2, 2)),
])
def test_controller_switching_tiers_is_lossless(small_vocab_model, name, drafter, schedule):
  """Sampled output under the controller equals the target's distribution (first token and
  the 3-token joint) while every generation moves from AR to a verifying tier: tier 0
  steps (the drafter idles), then a tier that drafts (it syncs first)."""
  graphdef, params = nnx.split(small_vocab_model)
  rows = 30_000
  costs = CostTable({(rows, g): 1.0 for g in (0, 1, 2)}, {rows: 0.0})
  controller = _ScheduledController(
      graphdef, drafter, sampling=SamplingSpec(greedy=False),
      config=ControllerConfig(tiers=(0, 1, 2), steps_per_decision=1,
                              max_steps_per_decision=1, probe_every=1, max_probe_every=1),
      cost_table=costs, schedule=schedule)
  check_engine_samples_match_target(controller, small_vocab_model, params, None, PROMPT,
                                    temperature=1.0, num_samples=rows, num_tokens=3)
  tiers = [g for g, _, _ in controller.last_trace]
  assert any(a == 0 and b > 0 for a, b in zip(tiers, tiers[1:])), tiers   # AR, then drafts


# Every token is followed by three different tokens in the prompt: an n-gram tree branches.
BRANCHING_PROMPT = [3, 4, 11, 9, 2, 7, 8, 0, 10, 1, 6, 5, 0, 11, 8, 10, 7, 5, 9, 1, 2, 3, 6,
                    4, 0, 7, 9, 10, 3, 1, 4, 5, 6, 2, 8, 11]


@pytest.mark.slow
def test_controller_switching_node_budgets_is_lossless(small_vocab_model):
  """verify_length=auto_tree at T=1: each generation verifies a 7-node n-gram trie, then
  an AR step, then a 3-node trie (the cycle repeats); the 3-token joint and the first two
  tokens' joint match the target's."""
  graphdef, params = nnx.split(small_vocab_model)
  rows = 20_000
  costs = CostTable({(rows, g): 1.0 for g in (0, 2, 6)}, {rows: 0.0})
  controller = _ScheduledController(
      graphdef, NgramDrafter(num_draft=2, min_n=1, max_n=1),
      sampling=SamplingSpec(greedy=False), tree=TreeConfig(num_nodes=7, top_k=3),
      config=ControllerConfig(tiers=(0, 2, 6), steps_per_decision=1,
                              max_steps_per_decision=1, probe_every=1, max_probe_every=1),
      cost_table=costs, schedule=(6, 0, 2))
  check_engine_samples_match_target(controller, small_vocab_model, params, None,
                                    BRANCHING_PROMPT, temperature=1.0, num_samples=rows,
                                    num_tokens=3, max_new_tokens=7)
  first = [(g, n) for g, n, _ in controller.last_trace[:3]]
  assert first == [(6, rows), (0, rows), (2, rows)], first   # every row ran each budget
