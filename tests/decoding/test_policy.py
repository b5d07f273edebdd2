"""`policy.decide` on its own: every mode of the controller, no device work."""

import dataclasses

import numpy as np
import pytest

from dspec.decoding.costs import CostTable
from dspec.decoding.estimate import AcceptanceEstimate
from dspec.decoding.policy import ControllerConfig, PolicyState, decide

TIERS = (0, 1, 3)
CFG = ControllerConfig(tiers=TIERS, steps_per_decision=2, max_steps_per_decision=16,
                       chunk_seconds=1.0, probe_every=8, shadow_warmup=2)


def _costs(per_token=0.001, propose=0.0, ar=0.01):
  return CostTable({(1, g): ar + per_token * g for g in TIERS}, {1: propose})


def _estimate(accepted=None):
  """The prior (None), or 10 verified steps at tier 3 accepting `accepted` drafts each."""
  est = AcceptanceEstimate(1, 3, CFG)
  if accepted is not None:
    hist = np.zeros((1, 4))
    hist[0, accepted] = 10
    est.observe(hist, np.array([10]), gamma=3)
  return est


def _state(costs, *, exact=True, retrospective=False, carried=False, remaining=100, **kw):
  state = PolicyState.start(CFG, costs, 1, TIERS, exact=exact, retrospective=retrospective,
                            carried=carried, live_B=np.array([True]),
                            remaining_B=np.array([remaining]))
  return dataclasses.replace(state, **kw)


def test_payable_exact_cheap_and_shadow_probe_facts():
  assert _state(_costs()).payable == (1, 3)
  assert _state(_costs(per_token=1.0)).payable == ()
  assert _state(_costs()).cheap and _state(_costs()).shadow_probe
  assert not _state(_costs(propose=1.0)).cheap          # costs over `shadow_budget`
  inexact = _state(_costs(), exact=False, retrospective=True)
  assert not (inexact.cheap or inexact.shadow_probe or inexact.retrospective)
  assert not _state(_costs(per_token=1.0)).cheap        # nothing payable: nothing to learn
  assert _state(_costs(propose=1.0), retrospective=True).cheap   # judged after the fact


def test_unpayable_runs_plain_ar_to_the_end():
  d = decide(_estimate(3), _costs(per_token=1.0), _state(_costs(per_token=1.0)))
  assert (d.tier, d.chunk, d.plain_ar, d.probe, d.shadow) == (0, 100, True, False, False)


def test_first_look_before_any_evidence():
  cheap = decide(_estimate(), _costs(), _state(_costs()))
  assert (cheap.tier, cheap.probe, cheap.shadow, cheap.chunk) == (0, False, True, 2)
  # Costly proposals: the first look is a probe, judging every position (γ_max + 1 steps).
  costly = decide(_estimate(), _costs(propose=1.0), _state(_costs(propose=1.0)))
  assert (costly.tier, costly.probe, costly.shadow, costly.chunk) == (0, True, True, 4)
  # A carried prior, or retrospective evidence, verifies at once.
  for state in (_state(_costs(), carried=True), _state(_costs(), retrospective=True)):
    assert decide(_estimate(), _costs(), state).tier == 3


def test_probing_doubles_the_interval_while_probes_find_nothing():
  costs = _costs(propose=1.0)
  state = _state(costs, chunks=3, prev=0, idle=8)
  d = decide(_estimate(0), costs, state)
  assert (d.tier, d.probe, d.shadow, d.chunk) == (0, True, True, 4)
  assert d.state.probe_every == 8 and d.state.idle == 4 and d.state.probed is not None
  # The probe's sample did not raise the best tier's prospect: the interval doubles.
  after = decide(_estimate(0), costs, d.state)
  assert (after.tier, after.probe, after.state.probe_every) == (0, False, 16)
  assert after.chunk == 16 - 4 and after.state.probed is None
  # It raised it (but not past the margin): the next probe comes as soon as the last.
  better = _estimate(0)
  hist = np.zeros((1, 4))
  hist[0, 1] = 1
  better.observe(hist, np.array([1]), gamma=3)
  after = decide(better, costs, d.state)
  assert after.tier == 0 and after.state.probe_every == CFG.probe_every, after
  # Not due yet: one chunk until it is, no evidence meanwhile; not plain AR (a probe follows).
  d = decide(_estimate(0), costs, dataclasses.replace(state, idle=3))
  assert (d.tier, d.probe, d.shadow, d.chunk, d.plain_ar) == (0, False, False, 5, False)
  # Inexact shadow evidence (sampling drafter at T > 0): the probe verifies tier 1.
  d = decide(_estimate(0), costs, _state(costs, exact=False, chunks=3, prev=0, idle=8))
  assert (d.tier, d.probe, d.shadow) == (1, True, False)
  # A positive tier resets the interval.
  d = decide(_estimate(3), costs, dataclasses.replace(state, probe_every=64))
  assert d.tier == 3 and d.state.probe_every == CFG.probe_every and d.state.idle == 0


def test_final_ar_when_the_tier0_chunk_reaches_the_end():
  costs = _costs(propose=1.0)
  d = decide(_estimate(0), costs, _state(costs, chunks=3, prev=0, idle=0, remaining=5))
  assert (d.tier, d.chunk, d.plain_ar) == (0, 8, True)   # the run stops when done


def test_chunks_grow_while_the_tier_holds():
  costs = _costs()
  d = decide(_estimate(3), costs, _state(costs, chunks=2, prev=3, chunk=4))
  assert (d.tier, d.chunk, d.shadow) == (3, 8, False)       # x2; largest tier: no shadow
  d = decide(_estimate(3), costs, _state(costs, chunks=2, prev=3, chunk=16))
  assert d.chunk == 16                                      # max_steps_per_decision
  d = decide(_estimate(3), costs, _state(costs, chunks=2, prev=1, chunk=8))
  assert d.chunk == CFG.steps_per_decision                  # the tier changed
  # Tier 0 with shadow drafts: x4 once `shadow_warmup` samples came in.
  d = decide(_estimate(0), costs, _state(costs, chunks=2, prev=0, chunk=2, shadowed=2))
  assert (d.tier, d.chunk, d.shadow) == (0, 8, True)
  d = decide(_estimate(0), costs, _state(costs, chunks=2, prev=0, chunk=2, shadowed=1))
  assert d.chunk == 2


def test_shadow_now_below_the_largest_tier():
  costs = _costs()
  one = CostTable({(1, 0): 0.01, (1, 1): 0.0105, (1, 3): 0.04}, {1: 0.0})
  d = decide(_estimate(1), one, _state(one, chunks=2, prev=1, chunk=2))
  assert (d.tier, d.shadow) == (1, True)
  assert not decide(_estimate(3), costs, _state(costs, chunks=2, prev=3)).shadow


def test_retrospective_tier0_chunks_run_long():
  costs = _costs()
  d = decide(_estimate(0), costs, _state(costs, retrospective=True, chunks=1, prev=0))
  assert (d.tier, d.shadow, d.chunk) == (0, True, 4 * CFG.max_steps_per_decision)


def _host_walk(taken, proposed=True, samples=8):
  """An estimate after a host drafter's walk judged in retrospect (`HostSession.judge`):
  `samples` steps taking `taken` of 3 drafts each (or proposing nothing)."""
  est = AcceptanceEstimate(1, 3, CFG)
  est.observe_shadow(np.full((1, samples), taken), np.full((1, samples), 3),
                     np.full((1, samples), proposed))
  return est


def test_host_drafters_fall_back_to_tier_0_and_speculate_where_a_walk_pays():
  """A host drafter is judged in retrospect (its fallback is tier 0 of the policy): a
  silent one (suffix misses) or one whose drafts are rejected runs tier-0 chunks, each
  judged, short at first and doubling (its paying stretches come in bursts); a walk that takes its drafts moves it to the tier that pays; at the
  largest tier it runs without judging, growing its chunks; with no tier payable it runs
  plain AR to the end, judging nothing."""
  costs = _costs()
  host = _state(costs, retrospective=True, bursty=True, chunks=1, prev=3)
  assert host.cheap and host.retrospective and host.bursty
  long = 4 * CFG.max_steps_per_decision
  for est in (_host_walk(0, proposed=False), _host_walk(0)):
    d = decide(est, costs, host)   # short after a positive tier, doubling up to long
    chunks = [d.chunk]
    while chunks[-1] < long:
      d = decide(est, costs, d.state)
      assert (d.tier, d.shadow, d.plain_ar) == (0, True, False)
      chunks.append(d.chunk)
    assert chunks == [4, 8, 16, 32, 64]
  assert decide(_host_walk(0), costs, dataclasses.replace(host, bursty=False)).chunk == long
  d = decide(_host_walk(3), costs, dataclasses.replace(host, prev=0))
  assert (d.tier, d.shadow, d.chunk) == (3, False, CFG.steps_per_decision)
  d = decide(_host_walk(3), costs, d.state)
  assert (d.tier, d.chunk) == (3, 2 * CFG.steps_per_decision)
  # A walk taking one draft a step: the short tier, judged (a longer one may pay later).
  one = CostTable({(1, 0): 0.01, (1, 1): 0.0105, (1, 3): 0.04}, {1: 0.0})
  d = decide(_host_walk(1), one, _state(one, retrospective=True, chunks=1, prev=0))
  assert (d.tier, d.shadow) == (1, True)
  unpayable = _costs(per_token=1.0)
  d = decide(_host_walk(3), unpayable, _state(unpayable, retrospective=True))
  assert (d.tier, d.plain_ar, d.shadow, d.chunk) == (0, True, False, 100)


def test_realised_ratio_scales_a_tier_down():
  costs = _costs()
  state = _state(costs, chunks=2, prev=3, chunk=2)
  d = decide(_estimate(3), costs, state)
  assert d.predicted[3] == pytest.approx(4.0, rel=0.1)
  after = d.state.observed(d, committed=2.0, steps=2, live_B=[True], remaining_B=[98])
  assert after.ratio(3) == pytest.approx(0.5 * (1 + 1 / d.predicted[3]))
  assert decide(_estimate(3), costs, after).predicted[3] < d.predicted[3]
  # A tier-0 chunk: its shadow samples move the ratio as a verified chunk would, up where
  # every draft matched, down where none did; a chunk without samples keeps it.
  ar = dataclasses.replace(d, tier=0, predicted=decide(_estimate(3), costs, after).predicted)
  kept = after.observed(ar, committed=4.0, steps=4, live_B=[True], remaining_B=[94])
  assert kept.ratio(3) == after.ratio(3)
  up = after.observed(ar, committed=4.0, steps=4, live_B=[True], remaining_B=[94],
                      shadow_samples=1, shadow_accepted=np.array([2]))
  assert after.ratio(3) < up.ratio(3) < 1.0
  cleared = after.observed(ar, committed=4.0, steps=4, live_B=[True], remaining_B=[94],
                           shadow_samples=1, shadow_accepted=np.array([3]))
  assert cleared.ratio(3) == 1.0
  down = after.observed(ar, committed=4.0, steps=4, live_B=[True], remaining_B=[94],
                        shadow_samples=1, shadow_accepted=np.array([0]))
  assert down.ratio(3) < after.ratio(3)


def test_makespan_objective():
  cfg = dataclasses.replace(CFG, objective='makespan')
  costs = _costs()
  state = dataclasses.replace(_state(costs, chunks=2, prev=3), config=cfg)
  assert decide(_estimate(3), costs, state).tier == 3
  assert decide(_estimate(0), costs, state).tier == 0


def test_config_rejects_bad_knobs():
  for bad in (dict(tiers=(3, 1)), dict(objective='fast'), dict(probe_every=0),
              dict(probe_every=64, max_probe_every=8)):
    with pytest.raises(ValueError, match='controller'):
      ControllerConfig(**bad)


def test_every_knob_is_a_config_field():
  from configs import common
  cfg = common.decode_config()
  cfg.controller.margin = 0.3
  assert ControllerConfig.from_config(cfg.controller) == dataclasses.replace(
      ControllerConfig(), margin=0.3)
  with pytest.raises(ValueError, match='unknown knobs'):
    ControllerConfig.from_config({'marjin': 0.3})
