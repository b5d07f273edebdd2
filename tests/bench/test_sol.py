"""Speed-of-light figures: nothing labelled a bound or ceiling is beaten by a measured τ.

Synthetic targets in numpy: a deterministic next-token table (T = 0) and Markov chains
(T > 0), decoded with the engine's rules: a step verifies γ drafts, commits the accepted
ones plus the target's token, cut at a stop token and at the budget; the prefill's token
is no step's. τ = committed tokens / verify steps over all prompts (`metrics`).
"""

import math

import numpy as np
import pytest

from dspec.bench import sol

V, STOP = 24, 0


def _commit(n_accepted, emitted, remaining):
  """Tokens one step commits: accepted drafts + 1, cut at a stop token and the budget."""
  out = list(emitted[:n_accepted + 1])
  if STOP in out:
    out = out[:out.index(STOP) + 1]
  return out[:remaining]


def _greedy_run(table, prompt_token, budget, gamma, draft_fn):
  """Greedy speculative decoding of the deterministic target `table`; (ids, steps)."""
  ids = [int(table[prompt_token])]                     # the prefill's token
  steps = 0
  while len(ids) < budget and ids[-1] != STOP:
    truth, prev = [], ids[-1]
    for _ in range(gamma + 1):
      prev = int(table[prev])
      truth.append(prev)
    drafts = draft_fn(ids, truth[:gamma])
    n = next((j for j in range(gamma) if drafts[j] != truth[j]), gamma)
    ids += _commit(n, truth, budget - len(ids))
    steps += 1
  return ids, steps


@pytest.mark.parametrize('gamma', [1, 3, 7, 15])
def test_measured_greedy_tau_never_beats_the_oracle_ceiling(gamma):
  rng = np.random.default_rng(gamma)
  table = rng.integers(0, V, V)
  table[rng.integers(1, V)] = STOP                     # some prompts stop early
  prompts, budgets = rng.integers(1, V, 12), rng.integers(1, 40, 12)

  def noisy(quality):
    def draft(ids, truth):
      return [t if rng.random() < quality else (t + 1) % V for t in truth]
    return draft

  ar = [_greedy_run(table, p, b, 0, noisy(0.0))[0] for p, b in zip(prompts, budgets)]
  ceiling = sol.greedy_oracle_ceiling(ar, gamma + 1)
  for quality in (0.0, 0.5, 0.9, 1.0):
    runs = [_greedy_run(table, p, b, gamma, noisy(quality))
            for p, b in zip(prompts, budgets)]
    assert [ids for ids, _ in runs] == ar, 'greedy output is AR output'
    committed = sum(len(ids) - 1 for ids, _ in runs)
    tau = committed / max(sum(s for _, s in runs), 1)
    assert tau <= ceiling + 1e-12
    if quality == 1.0:
      assert tau == pytest.approx(ceiling), 'the perfect oracle reaches the ceiling'


def test_greedy_oracle_ceiling_counts_the_budget_cut():
  # 10 generated = 1 prefill + 9 by verify steps of up to 8: 2 steps.
  assert sol.greedy_oracle_ceiling([list(range(10))], 8) == 4.5
  assert sol.greedy_oracle_ceiling([list(range(17))], 8) == 8.0
  # Token-weighted over prompts: (9 + 16 + 0) / (2 + 2 + 0).
  assert sol.greedy_oracle_ceiling([range(10), range(17), [5]], 8) == 25 / 4
  assert sol.greedy_oracle_ceiling([[5], []], 8) == 1.0, 'no verify step'
  assert sol.greedy_oracle_ceiling([range(10)], 1) == 1.0, 'AR'
  with pytest.raises(ValueError, match='verify_width'):
    sol.greedy_oracle_ceiling([range(10)], 0)


def _entropy(p):
  p = p[p > 0]
  logp = np.log(p)
  return -np.sum(p * logp), np.sum(p * logp ** 2)


def _sampled_run(trans, rng, gamma, num_tokens):
  """Speculative sampling of a Markov target with a deterministic (argmax-chain) drafter
  and exact one-hot rejection sampling; (τ, μ, μ₂) along the generated tokens."""
  ids, steps, moments = [0], 0, []
  while len(ids) < num_tokens:
    drafts, prev = [], ids[-1]
    for _ in range(gamma):
      prev = int(np.argmax(trans[prev]))
      drafts.append(prev)
    emitted, prev = [], ids[-1]
    for d in drafts:
      p = trans[prev]
      if rng.random() < p[d]:                        # accept w.p. p(d) / q(d), q one-hot
        emitted.append(d)
        prev = d
        continue
      residual = p.copy()
      residual[d] = 0.0
      emitted.append(int(rng.choice(V, p=residual / residual.sum())))
      break
    else:
      emitted.append(int(rng.choice(V, p=trans[prev])))   # bonus
    for tok in emitted:
      moments.append(_entropy(trans[ids[-1]]))           # the distribution it came from
      ids.append(tok)
    steps += 1
  mu, mu2 = np.mean(moments, axis=0)
  return (len(ids) - 1) / steps, mu, mu2


@pytest.mark.parametrize('concentration', [0.03, 0.3, 3.0])
@pytest.mark.parametrize('gamma', [1, 3, 7, 15])
def test_measured_sampled_tau_never_beats_sol_bound(concentration, gamma):
  rng = np.random.default_rng(int(concentration * 100) + gamma)
  trans = rng.dirichlet(np.full(V, concentration), size=V)
  tau, mu, mu2 = _sampled_run(trans, rng, gamma, 3000)
  assert 1.0 <= tau <= sol.sol_bound(mu, mu2, gamma + 1)


def test_sol_bound_holds_for_the_best_chain_on_iid_sources():
  """An iid source's best deterministic chain proposes the mode: τ = 1 + Σ_k pmax^k.
  Peaked heads with thin tails, near-uniform and Dirichlet draws of every sharpness."""
  rng = np.random.default_rng(0)
  dists = [np.array([a] + [(1 - a) / n] * n) for a in np.linspace(0.02, 0.998, 60)
           for n in (1, 2, 5, 100, 10_000)]
  dists += [rng.dirichlet(np.full(rng.integers(2, 300), 10 ** rng.uniform(-2, 1)))
            for _ in range(300)]
  for p in dists:
    mu, mu2 = _entropy(p)
    for gamma in (1, 2, 3, 7, 15):
      tau = 1 + sum(p.max() ** k for k in range(1, gamma + 1))
      assert tau <= sol.sol_bound(mu, mu2, gamma + 1) + 1e-12


def test_fields_per_temperature():
  ar = [list(range(10))]
  entropy = {'entropy_mu': 3.0, 'entropy_mu2': 10.0}
  greedy = sol.speed_of_light(0.0, 8, ar_outputs=ar)
  assert greedy == {'sol_bound': None, 'greedy_oracle_ceiling': 4.5}
  sampled = sol.speed_of_light(1.0, 8, entropy=entropy, ar_outputs=ar)
  assert sampled['greedy_oracle_ceiling'] is None
  assert sampled['sol_bound'] == pytest.approx(1 + 13 * math.log(8) / 9)
  # A drafter sampling from q = p is always accepted (τ = P), above the bound: none given.
  assert sampled['sol_bound'] < 8
  assert sol.speed_of_light(1.0, 8, entropy, sampled_proposals=True)['sol_bound'] is None
  with pytest.raises(ValueError, match='AR outputs'):
    sol.speed_of_light(0.0, 8)
  with pytest.raises(ValueError, match='entropy'):
    sol.speed_of_light(0.7, 8)
  with pytest.raises(ValueError, match='temperature > 0'):
    sol.EntropyMeter(None, None, 0.0, 0, 1.0)
