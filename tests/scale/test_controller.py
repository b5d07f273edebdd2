"""The verify-length controller: lossless at every tier, and it picks what pays."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from flax import nnx

from conftest import TINY, generate
from dspec.decoding.prompts import generated_ids, pad_prompts
from dspec.decoding.controller import VerifyLengthController
from dspec.decoding.tiers import tier_drafter
from dspec.decoding.costs import CostTable
from dspec.decoding.estimate import AcceptanceEstimate, expected_tokens, retrospective_match
from dspec.decoding.policy import ControllerConfig, choose
from dspec.decoding.drafter import TruncatedDrafter
from dspec.decoding.drafters.dflash import DFlashDrafter
from dspec.decoding.drafters.dspark import DSparkDrafter
from dspec.decoding.drafters.eagle3 import Eagle3Drafter
from dspec.decoding.drafters.mtp import MTPDrafter
from dspec.decoding.drafters.ngram import NgramDrafter
from dspec.decoding.drafters.self_draft import SelfDrafter
from dspec.decoding.drafters.suffix import SuffixDrafter
from dspec.decoding.engine import SpeculativeEngine
from dspec.decoding.tree_engine import TreeConfig, TreeEngine
from dspec.models.dflash import DFlashConfig, DFlashModel
from dspec.models.dspark import DSparkConfig, DSparkModel
from dspec.models.eagle3 import Eagle3Config, Eagle3Model
from dspec.models.mtp import MTP, MTPConfig

PROMPTS = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [9, 9, 1], [7, 20, 31, 7, 20, 31, 7, 44, 2, 7, 20]]
NEW_TOKENS = 24
TIERS = (0, 1, 3)
NGRAM = NgramDrafter(num_draft=8, max_n=3)


def _costs(per_token: float, propose: float = 0.0, batches=(len(PROMPTS),)):
  """cost(γ) = 1 + per_token·γ for the test batch sizes (no profiling in unit tests); a
  proposal costing `propose` (large: no shadow drafts, tier 0 probes instead)."""
  return CostTable({(b, g): 1.0 + per_token * g for g in TIERS for b in batches},
                   {b: propose for b in batches})


def _decode(engine, params, dparams):
  return generate(engine, params, dparams, PROMPTS, NEW_TOKENS)


@pytest.fixture(scope='module')
def ar(tiny_split):
  return _decode(SpeculativeEngine(tiny_split[0]), tiny_split[1], None)


@pytest.mark.slow
@pytest.mark.parametrize('name,drafter,per_token,propose', [
    ('ngram', NGRAM, 0.05, 0.0),
    ('self', SelfDrafter(num_draft=4), 0.6, 1e9),   # starts at AR, probes
    ('suffix', SuffixDrafter(num_draft=4, use_global_cache=False), 0.05, 0.0),   # host
])
def test_greedy_output_equals_ar_while_switching_tiers(tiny_split, ar, name, drafter,
                                                       per_token, propose):
  cfg = ControllerConfig(tiers=TIERS, steps_per_decision=1, max_steps_per_decision=2,
                         probe_every=2)
  controller = VerifyLengthController(tiny_split[0], drafter, config=cfg,
                                      cost_table=_costs(per_token, propose))
  outs, state = _decode(controller, tiny_split[1], None)
  assert outs == ar[0]
  used = {g for g, _, _ in controller.last_trace}
  assert len(used) >= 2, f'{name} should exercise several tiers, used {used}'
  assert state.stats.accept_hist_BG1.shape[1] == max(TIERS) + 1
  assert sum(controller.tier_usage().values()) == pytest.approx(1.0)


def _mtp(target):
  return MTPDrafter.from_model(MTP(MTPConfig(num_depths=3), TINY, rngs=nnx.Rngs(1)))


def _eagle3(target):
  model = Eagle3Model(Eagle3Config(target_layer_ids=(0, 1)), TINY, rngs=nnx.Rngs(1))
  model.init_head_from(target)
  return Eagle3Drafter.create(model, 3)


def _dflash(target):
  cfg = DFlashConfig.create(TINY.num_layers, num_layers=1, block_size=4, mask_token_id=63,
                            target_layer_ids=(0, 1))
  return DFlashDrafter.create(DFlashModel(cfg, TINY, rngs=nnx.Rngs(1)))


def _dspark(target):
  cfg = DSparkConfig.create(TINY.num_layers, num_layers=1, block_size=3, mask_token_id=63,
                            target_layer_ids=(0, 1), markov_rank=4)
  return DSparkDrafter.create(DSparkModel(cfg, TINY, rngs=nnx.Rngs(1)), verify_cost=0.0)


@dataclasses.dataclass(frozen=True)
class _Eager:
  """`inner` doing its whole `update` at tier 0 too (nothing recorded, nothing to sync)."""

  inner: object

  def __getattr__(self, name):
    return getattr(self.inner, name)

  def idle_update(self, *args):
    return self.inner.update(*args)


@pytest.mark.slow
@pytest.mark.parametrize('make,shadow_probes', [(_mtp, False), (_eagle3, False),
                                                (_dflash, False), (_dspark, False),
                                                (_mtp, True)],
                         ids=['mtp', 'eagle3', 'dflash', 'dspark', 'mtp-shadow'])
def test_idle_drafters_sync_before_probing(tiny_model, tiny_split, ar, make, shadow_probes):
  """MTP / EAGLE-3 / DFlash / DSpark at tier 0 only record the target's features; a probe
  first writes the recorded positions into their caches, in the state the next steps
  use. Greedy output equals AR, and catching up 12 positions per trip or γ + 1 = 4 per
  trip drafts exactly what updating the caches at every tier-0 step does."""
  drafter, params = make(tiny_model)
  cfg = ControllerConfig(tiers=TIERS, steps_per_decision=1, max_steps_per_decision=8,
                         probe_every=12, shadow_probes=shadow_probes)
  runs = []
  variants = ((_Eager(drafter), dataclasses.replace(drafter, catch_up_width=0),
               dataclasses.replace(drafter, catch_up_width=12)) if not shadow_probes
              else (drafter,))
  for variant in variants:
    controller = VerifyLengthController(tiny_split[0], variant, config=cfg,
                                        cost_table=_costs(0.6, 1e9), trace=True)
    assert type(controller.engines[0].drafter) is TruncatedDrafter
    outs, state = _decode(controller, tiny_split[1], params)
    assert outs == ar[0]
    runs.append((controller.last_trace, np.asarray(state.trace.drafts_SG)))
  trace = [g for g, _, _ in runs[-1][0]]
  if not shadow_probes:
    assert 0 in trace and any(g > 0 for g in trace[trace.index(0):]), trace
    (eager, drafts_eager), *deferred = runs   # row 0's drafts, every step
    assert drafts_eager.any()
    for later, drafts in deferred:
      assert [t[:2] for t in later] == [t[:2] for t in eager]
      np.testing.assert_array_equal(drafts, drafts_eager)


@pytest.mark.slow
def test_costly_drafter_probes_by_one_shadow_proposal(tiny_split, ar):
  """At T = 0 a costly drafter's probe is one unverified proposal of the largest tier,
  judged against the tokens tier 0 then commits: the target's own greedy drafts are all
  matched, so decoding leaves AR for the largest tier at once (a verified probe would
  have gone through tier 1, the smallest positive tier)."""
  cfg = ControllerConfig(tiers=TIERS, steps_per_decision=1, max_steps_per_decision=2,
                         probe_every=2)
  controller = VerifyLengthController(tiny_split[0], SelfDrafter(num_draft=3), config=cfg,
                                      cost_table=_costs(0.6, 1e9))
  outs, _ = _decode(controller, tiny_split[1], None)
  assert outs == ar[0]
  trace = [(g, n) for g, n, _ in controller.last_trace]
  assert trace[0] == (0, 2 * len(PROMPTS)), trace          # runs until the probe is due
  assert trace[1] == (0, 4 * len(PROMPTS)), trace          # the probe: γ + 1 tier-0 steps
  assert trace[2][0] == 3 and 1 not in {g for g, _ in trace}, trace


@pytest.mark.slow
def test_first_decision_looks_before_verifying(tiny_split, ar):
  """With verification this cheap the prior (α = 0.5) would verify a positive tier at
  once; without evidence the controller first runs tier 0 with a shadow proposal: one
  probe of γ + 1 steps for a costly drafter (then straight to the largest tier, whose
  drafts all match), one short chunk for a cheap one; the next generation's prior is
  what the last one learnt. (n-gram has evidence before any step:
  `test_ngram_is_judged_in_retrospect`.)"""
  cfg = ControllerConfig(tiers=TIERS, steps_per_decision=1, max_steps_per_decision=2)
  for drafter, propose, first in ((SelfDrafter(num_draft=3), 1e9, 4),
                                  (SelfDrafter(num_draft=3), 0.0, 1)):
    controller = VerifyLengthController(tiny_split[0], drafter, config=cfg,
                                        cost_table=_costs(0.05, propose))
    assert choose({0: 1.0, 1: 2.0, 3: 2.0},
                  controller.costs.payable(len(PROMPTS), TIERS, cfg.margin), cfg.margin)
    outs, _ = _decode(controller, tiny_split[1], None)
    assert outs == ar[0]
    trace = [(g, n // len(PROMPTS)) for g, n, _ in controller.last_trace]
    assert trace[0] == (0, first), trace
    assert any(g > 0 for g, _ in trace[1:]), trace
    # The next generation starts from the pooled estimate carried over: it verifies at once.
    outs, _ = _decode(controller, tiny_split[1], None)
    assert outs == ar[0] and controller.last_trace[0][0] > 0, controller.last_trace


@pytest.mark.slow
def test_probe_interval_carries_over_to_the_next_generation(tiny_model, tiny_split, ar):
  """A drafter whose probes do not pay (random MTP weights) is probed at doubling
  intervals (2, 4, 8, 16 steps); the next generation starts from the last interval, so its
  first AR chunk runs 16 steps and it probes once."""
  drafter, params = _mtp(tiny_model)
  cfg = ControllerConfig(tiers=TIERS, steps_per_decision=1, probe_every=2)
  controller = VerifyLengthController(tiny_split[0], drafter, config=cfg,
                                      cost_table=_costs(0.6, 1e9))
  traces = []
  for _ in range(2):
    outs, _ = _decode(controller, tiny_split[1], params)
    assert outs == ar[0]
    traces.append([(g, n // len(PROMPTS)) for g, n, _ in controller.last_trace])
    assert {g for g, _ in traces[-1]} == {0}, traces
  first, second = traces
  assert first[0] == (0, 2) and second[0] == (0, 16), traces
  assert len(second) < len(first), traces


@pytest.mark.slow
def test_makespan_objective_is_lossless_too(tiny_split, ar):
  cfg = ControllerConfig(tiers=TIERS, objective='makespan')
  controller = VerifyLengthController(tiny_split[0], NGRAM, config=cfg,
                                      cost_table=_costs(0.05))
  assert _decode(controller, tiny_split[1], None)[0] == ar[0]


@pytest.mark.slow
def test_expensive_verification_falls_back_to_ar(tiny_split, ar):
  controller = VerifyLengthController(tiny_split[0], NGRAM,
                                      config=ControllerConfig(tiers=TIERS),
                                      cost_table=_costs(10.0))
  outs, _ = _decode(controller, tiny_split[1], None)
  assert outs == ar[0]
  # No tier could pay even if every draft were accepted: one AR chunk, nothing proposed.
  assert [g for g, _, _ in controller.last_trace] == [0]
  assert controller.costs.payable(len(PROMPTS), TIERS, 0.1) == ()


@pytest.mark.slow
def test_unpayable_batch_runs_plain_ar_with_a_stateful_drafter(tiny_model, tiny_split, ar):
  """MTP (taps, cached depths) where no tier could pay: plain AR steps (no taps, no
  drafter update), one chunk, greedy output equal to AR's."""
  drafter, params = _mtp(tiny_model)
  controller = VerifyLengthController(tiny_split[0], drafter,
                                      config=ControllerConfig(tiers=TIERS),
                                      cost_table=_costs(10.0, 1e9))
  outs, _ = _decode(controller, tiny_split[1], params)
  assert outs == ar[0]
  assert [g for g, _, _ in controller.last_trace] == [0]
  assert controller._plain_ar.drafter.taps == ()


@pytest.mark.slow
def test_tier0_to_the_end_runs_plain_ar(tiny_model, tiny_split, ar):
  """A tier-0 chunk that runs to the end of the batch with no probe due (MTP, probes every
  512 steps) takes plain AR steps: the drafter state is left as the prefill made it (no
  taps recorded), and the output is AR's."""
  drafter, params = _mtp(tiny_model)
  controller = VerifyLengthController(tiny_split[0], drafter, config=ControllerConfig(
      tiers=TIERS, probe_every=512), cost_table=_costs(0.6, 1e9))
  prompt_BP, lens = pad_prompts(PROMPTS)
  with jax.transfer_guard('disallow'):
    state = controller.prefill(tiny_split[1], params, prompt_BP, lens,
                               max_new_tokens=NEW_TOKENS)
    before = jax.device_get(state.drafter_state)
    state = controller.generate(tiny_split[1], params, state)
  assert generated_ids(state) == ar[0]
  assert [g for g, _, _ in controller.last_trace] == [0]
  jax.tree.map(np.testing.assert_array_equal, before, jax.device_get(state.drafter_state))


@pytest.mark.slow
@pytest.mark.parametrize('per_node,expect_trees', [(0.0, True), (10.0, False)])
def test_node_budgets_are_chosen_from_costs_and_stay_lossless(tiny_split, ar, per_node,
                                                              expect_trees):
  """verify_length=auto_tree: tiers are n-gram tries of 2, 4 and 8 nodes or AR. Free
  nodes: the controller verifies trees, and greedy output equals AR's; costly nodes: it
  stays on AR (the never-slower floor)."""
  tiers, b = (0, 1, 3, 7), len(PROMPTS)
  costs = CostTable({(b, g): 1.0 + per_node * g for g in tiers}, {b: 0.0})
  controller = VerifyLengthController(
      tiny_split[0], NGRAM, config=ControllerConfig(tiers=tiers), cost_table=costs,
      tree=TreeConfig(num_nodes=8, top_k=2))
  assert all(isinstance(controller.engines[g], TreeEngine) for g in tiers[1:])
  outs, state = _decode(controller, tiny_split[1], None)
  assert outs == ar[0]
  used = {g for g, n, _ in controller.last_trace if n}
  if expect_trees:
    assert used & {3, 7}, used
    stats = jax.device_get(state.stats)
    assert stats.accepted_B.sum() > 0   # tree paths were accepted
  else:
    assert used == {0}, used


@pytest.mark.slow
def test_profiling_fills_the_cost_table_and_round_trips(tiny_split, tmp_path):
  cfg = ControllerConfig(tiers=(0, 1), profile_steps=2, profile_repeats=1)
  controller = VerifyLengthController(tiny_split[0], NGRAM, config=cfg)
  prompt_BP, lens = pad_prompts(PROMPTS)
  state = controller.prefill(tiny_split[1], None, prompt_BP, lens, max_new_tokens=NEW_TOKENS)
  table = controller.profile(tiny_split[1], None, state)
  assert table.has(len(PROMPTS), (0, 1)) and all(c > 0 for c in table.costs.values())
  table.save(str(tmp_path / 'costs.json'))
  loaded = CostTable.load(str(tmp_path / 'costs.json'))
  assert loaded.costs == table.costs and loaded.propose == table.propose
  (tmp_path / 'bad.json').write_text('{"seconds_per_step": 3}')
  with pytest.raises(ValueError, match='bad step-cost table'):
    CostTable.load(str(tmp_path / 'bad.json'))


def test_acceptance_estimate_and_expected_tokens():
  cfg = ControllerConfig(prior=0.5, prior_weight=1e-9, ema=0.0)
  est = AcceptanceEstimate(batch=2, max_gamma=4, cfg=cfg)
  np.testing.assert_allclose(est.proposal_rate(), [1.0, 1.0])   # assumed to draft
  # Row 0: 6 steps at γ=2, two of them without a proposal, the others accepting 0, 1, 2,
  # 2 drafts; row 1: nothing observed.
  est.observe(np.array([[3, 1, 2, 0, 0], [0, 0, 0, 0, 0]]), np.array([4, 0]), gamma=2)
  alpha, rate = est.conditional(), est.proposal_rate()
  np.testing.assert_allclose(alpha[0, :2], [3 / 4, 2 / 3], rtol=1e-6)
  np.testing.assert_allclose(alpha[0, 2:], [2 / 3, 2 / 3], rtol=1e-6)   # extrapolated
  np.testing.assert_allclose(alpha[1], alpha[0], rtol=1e-6)   # unseen row: pooled
  np.testing.assert_allclose(rate, [4 / 6, 4 / 6], rtol=1e-6)
  live = np.array([True, False])
  assert expected_tokens(alpha, 0, live, np.array([9, 9]), rate) == 1.0
  assert expected_tokens(alpha, 2, live, np.array([9, 9]), rate) == \
      pytest.approx(1 + 4 / 6 * (3 / 4 + 1 / 2))
  assert expected_tokens(alpha, 2, live, np.array([1, 9]), rate) == 1.0
  # A step costs the drafting step's price only when some live row proposes.
  table = CostTable({(2, 0): 1.0, (2, 2): 3.0}, {2: 0.1})
  cost = lambda g, live: table.step_cost(2, g, est.proposal_rate(), live)
  assert cost(0, live) == 1.0
  assert cost(2, live) == pytest.approx(4 / 6 * 3.0 + 2 / 6 * 1.1)
  assert cost(2, np.array([True, True])) == pytest.approx(
      (1 - (2 / 6) ** 2) * 3.0 + (2 / 6) ** 2 * 1.1)


@pytest.mark.slow
def test_ngram_is_judged_in_retrospect(tiny_split, ar):
  """After a chunk the n-gram drafter's proposals at every committed length are
  recomputed and walked as a verifying tier would have (here by hand: no match at length
  3, three drafts accepted at 4, the one draft judgeable at 8 rejected); the controller
  judges the prompt so before its first step; forced-wide steps (what the cost profile
  times) commit what AR does."""
  tokens_BL = np.array([[1, 2, 3, 1, 2, 3, 1, 2, 4, 0, 0, 0]], np.int32)
  drafter = NgramDrafter(num_draft=3, min_n=1, max_n=2)
  accepted, judged, proposed = jax.device_get(retrospective_match(
      drafter, 8, tokens_BL, np.array([3], np.int32), np.array([9], np.int32)))
  assert accepted[0, :4].tolist() == [0, 3, 0, 0]
  assert judged[0, :4].tolist() == [3, 3, 1, 0] and not judged[0, 3:].any()
  assert proposed[0, :3].tolist() == [False, True, True]
  est = AcceptanceEstimate(1, 3, ControllerConfig(prior_weight=1e-9, ema=0.0))
  est.observe_shadow(accepted, judged, proposed)
  np.testing.assert_allclose(est.conditional()[0], [1 / 2, 1, 1], rtol=1e-6)
  np.testing.assert_allclose(est.proposal_rate(), [2 / 3], rtol=1e-6)

  controller = VerifyLengthController(tiny_split[0], NGRAM, config=ControllerConfig(
      tiers=TIERS), cost_table=_costs(0.05, batches=(2, 3)))
  outs, _ = _decode(controller, tiny_split[1], None)
  assert outs == ar[0]
  # The repetitive prompts judged so, it verifies from the first step (no tier-0 look);
  # prompts without a repeat, where n-gram proposes nothing, keep it at AR.
  assert controller.last_trace[0][0] > 0, controller.last_trace
  generate(controller, tiny_split[1], None, [list(range(10, 20)), list(range(30, 37))], 8)
  assert controller.last_trace[0][0] == 0, controller.last_trace
  engine = SpeculativeEngine(tiny_split[0], drafter=NGRAM)
  prompt_BP, lens = pad_prompts(PROMPTS)
  state = engine.prefill(tiny_split[1], None, prompt_BP, lens, max_new_tokens=NEW_TOKENS)
  state = engine.run(tiny_split[1], None, state, force_wide=True)
  assert generated_ids(state) == ar[0]


@pytest.mark.slow
def test_ngram_tier0_chunks_run_past_the_decision_cap(tiny_split):
  """Judged in retrospect, n-gram's tier-0 chunks run 4 × `chunk_seconds` of AR steps, up
  to 4 × `max_steps_per_decision` (the judge covers the chunk's last lengths): without a
  repeat, a 12-token generation (11 steps) runs 8 steps at once, then the rest."""
  controller = VerifyLengthController(tiny_split[0], NGRAM, config=ControllerConfig(
      tiers=TIERS, steps_per_decision=1, max_steps_per_decision=2, chunk_seconds=2.0),
      cost_table=_costs(0.05, batches=(2,)))
  generate(controller, tiny_split[1], None, [list(range(10, 20)), list(range(30, 37))], 12)
  assert controller.last_trace[0][:2] == (0, 2 * 8), controller.last_trace


def test_tiers_resize_or_truncate():
  assert tier_drafter(NgramDrafter(num_draft=8), 3).num_draft == 3
  assert tier_drafter(NgramDrafter(num_draft=8), 0) == TruncatedDrafter(NgramDrafter(), 0)
  with pytest.raises(ValueError, match='num_draft'):
    NgramDrafter(num_draft=8).with_num_draft(0)
  tier = TruncatedDrafter(SelfDrafter(num_draft=4), 0)
  assert tier.num_draft == 0 and tier.taps == ()
  with pytest.raises(ValueError, match='tiers'):
    ControllerConfig(tiers=(3, 1))
  with pytest.raises(ValueError, match='objective'):
    ControllerConfig(objective='fast')


@pytest.mark.multiprocess
@pytest.mark.slow
def test_controller_on_a_mesh_equals_ar():
  """`verify_length=auto` with a `data=2,tensor=2` placement (4 simulated CPU devices, in a
  subprocess: `controller_mesh_check.py`): the decode job is lossless against AR, and on a
  table where verifying is cheap the controller runs positive tiers sharded, token for
  token equal to AR: n-gram, suffix (host-proposed tiers, AR as tier 0), and n-gram trees
  under `tree` and `auto_tree`."""
  here = os.path.dirname(os.path.abspath(__file__))
  proc = subprocess.run([sys.executable, os.path.join(here, 'controller_mesh_check.py')],
                        capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, JAX_PLATFORMS='cpu'))
  line = next((l for l in proc.stdout.splitlines() if l.startswith('RESULT ')), None)
  assert proc.returncode == 0 and line, proc.stderr[-4000:]
  result = json.loads(line[len('RESULT '):])
  assert result['devices'] == 4 and result['verify_length'] == 'auto'
  assert result['lossless'] is True and all(result['equal_ar'].values()), result
  for name in ('auto', 'suffix', 'auto_tree'):   # positive tiers ran, sharded
    assert any(int(g) > 0 for g in result['cheap_tier_steps'][name]), result


@pytest.mark.slow
def test_profiled_costs_are_cached_beside_the_xla_cache(tiny_split, ar, tmp_path,
                                                        monkeypatch):
  """A second controller for the same model, drafter, shapes and device loads the table
  its predecessor profiled (`controller_costs/` in the XLA cache) instead of profiling;
  with the XLA cache off nothing is cached."""
  from dspec.decoding import costs as costs_lib
  monkeypatch.setattr(costs_lib, 'cache_dir', lambda: str(tmp_path))
  cfg = ControllerConfig(tiers=TIERS, profile_steps=1, profile_repeats=1)
  first = VerifyLengthController(tiny_split[0], NGRAM, config=cfg)
  assert _decode(first, tiny_split[1], None)[0] == ar[0]
  assert len(list(tmp_path.iterdir())) == 1
  second = VerifyLengthController(tiny_split[0], NGRAM, config=cfg)
  monkeypatch.setattr(second, 'profile', lambda *a: pytest.fail('profiled again'))
  assert _decode(second, tiny_split[1], None)[0] == ar[0]
  assert second.costs.costs == first.costs.costs
  monkeypatch.setattr(costs_lib, 'cache_dir', lambda: None)
  assert costs_lib.cached_path('setup', []) is None
