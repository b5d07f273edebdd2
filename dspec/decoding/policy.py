"""The controller's policy: which tier, for how many steps, with what evidence.

`decide(estimate, costs, state)` is pure (numpy on host copies, no device calls): from an
`AcceptanceEstimate`, a `CostTable` and the `PolicyState` of a generation it returns the
next chunk's `Decision`: its tier (verify length; 0 is AR), its length in steps, whether it
is a probe, whether a shadow proposal of the largest tier is judged against what it
commits, and whether it runs plain AR steps (no proposals, no taps, no drafter update).
`PolicyState.observed` folds in what the chunk realised. The modes:

  * exact: shadow evidence has the probability a verification would accept (greedy, or
    a drafter proposing tokens rather than samples);
  * retrospective: exact and the drafter proposes from the tokens alone (n-gram, or a
    host drafter: suffix trees): judged after each chunk at every length it committed;
  * cheap: some tier is payable and shadow evidence is exact and costs under
    `shadow_budget` of a chunk (or is retrospective): shadow drafts every chunk;
  * shadow_probe: exact and `shadow_probes`: tier 0 probes by one shadow proposal;
  * first_look: before any evidence (no carried prior), tier 0 with a shadow proposal
    rather than verifying a tier on the prior;
  * probing: a tier-0 probe is due (`probe_every` steps at tier 0; doubles after a probe
    that did not raise the best tier's prospect, and stays after one that did);
  * grow: the tier is unchanged, so the chunk grows (x2; x4 at tier 0);
  * shadow (shadow_now): the chunk carries a shadow proposal;
  * final_ar (plain_ar): nothing will be proposed before the batch ends;
  * payable: the tiers that could beat AR by `margin` if every draft were accepted.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, Optional, Tuple

import numpy as np

from dspec.config_checks import check_float, check_int
from dspec.decoding.estimate import expected_tokens, row_tokens
from dspec.errors import UserError


# The most steps any step-count knob may ask for (a chunk, a probe interval, a profiling
# run): far past where a longer chunk amortises anything, and small enough that the
# buffers sized by it (`retrospective_match`'s [B, width] samples) stay small.
MAX_STEPS = 2 ** 16
MAX_PROFILE_REPEATS = 100   # timed rounds over every tier before the first generation


def _check_tiers(tiers, name: str) -> Tuple[int, ...]:
  """`tiers` as a tuple of ints: sorted, distinct, from 0 (AR: the tier every controller
  falls back to)."""
  if not isinstance(tiers, (list, tuple)) or not tiers:
    raise UserError(f'{name} must be a non-empty tuple of verify lengths, got {tiers!r}')
  tiers = tuple(check_int(g, name) for g in tiers)
  if sorted(set(tiers)) != list(tiers) or tiers[0] != 0:
    raise UserError(f'{name} must be sorted, distinct and start at 0 (AR), got {tiers}')
  return tiers


def _check_objective(value, name: str) -> str:
  if value not in ('makespan', 'throughput'):
    raise UserError(f'{name} must be makespan or throughput, got {value!r}')
  return value


def _check_bool(value, name: str) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise UserError(f'{name} must be True or False, got {value!r}')
  return bool(value)


_STEPS = functools.partial(check_int, low=1, high=MAX_STEPS)
_POSITIVE = functools.partial(check_float, low=0.0, low_open=True)
# Each knob's check: check(value, 'controller.<knob>') -> the value (4.0 -> 4), or a
# UserError naming the knob. `ControllerConfig` runs every knob's, so a knob without one
# fails at import.
_CHECKS = {
    'tiers': _check_tiers,
    'steps_per_decision': _STEPS,
    'max_steps_per_decision': _STEPS,
    'chunk_seconds': _POSITIVE,
    'margin': functools.partial(check_float, low=0.0),
    'objective': _check_objective,
    'ema': functools.partial(check_float, low=0.0, high=1.0, high_open=True),
    'prior': functools.partial(check_float, low=0.0, high=1.0, low_open=True),
    'prior_weight': _POSITIVE,   # 0 leaves the estimate 0 / 0 before any evidence
    'probe_every': _STEPS,
    'max_probe_every': _STEPS,
    'shadow_probes': _check_bool,
    'profile_steps': _STEPS,
    'profile_repeats': functools.partial(check_int, low=1, high=MAX_PROFILE_REPEATS),
    'shadow_budget': functools.partial(check_float, low=0.0),
    'shadow_warmup': functools.partial(check_int, low=0, high=MAX_STEPS),
}
# Knobs that bound another: (knob, bound) with knob <= bound.
_ORDERED = (('steps_per_decision', 'max_steps_per_decision'),
            ('probe_every', 'max_probe_every'))


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
  """Every knob of the verify-length policy (`--config.controller.*`; hashable). The
  runner keeps the `tiers` below the drafter's num_draft, and adds num_draft. Built only
  with every knob in its range (`_CHECKS`) and consistent (UserError naming the knob)."""

  tiers: Tuple[int, ...] = (0, 1, 3, 7, 15)
  steps_per_decision: int = 4       # steps per decision (one host sync each)
  max_steps_per_decision: int = 64  # chunk cap while the tier does not change
  chunk_seconds: float = 0.1        # ... and chunks grow only up to this much device time
  margin: float = 0.1               # speculate only when predicted >= (1 + margin) × AR
  objective: str = 'throughput'     # throughput | makespan (time until the last row ends)
  ema: float = 0.8                  # weight of the past in the acceptance counts
  prior: float = 0.5                # conditional acceptance before any evidence
  prior_weight: float = 2.0         # pseudo-steps pulling a row towards the pooled estimate
  probe_every: int = 32             # steps at tier 0 before probing a positive tier
  max_probe_every: int = 512
  shadow_probes: bool = True        # probe by one shadow proposal where that is exact
  profile_steps: int = 8            # steps timed per tier at start-up
  profile_repeats: int = 3          # timed rounds over the tiers (after a compile round)
  shadow_budget: float = 0.1        # shadow-propose when it costs < this × a chunk
  shadow_warmup: int = 2            # short tier-0 chunks until this many shadow samples

  @classmethod
  def from_config(cls, cfg) -> 'ControllerConfig':
    """From a config's `controller` section (a mapping of these fields)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(cfg) - fields)
    if unknown:
      raise UserError(f'controller: unknown knobs {unknown} (known: {sorted(fields)})')
    return cls(**dict(cfg))

  def __post_init__(self):
    for name in (f.name for f in dataclasses.fields(self)):
      value = _CHECKS[name](getattr(self, name), f'controller.{name}')
      object.__setattr__(self, name, value)
    for knob, bound in _ORDERED:
      if getattr(self, knob) > getattr(self, bound):
        raise UserError(f'controller.{knob}={getattr(self, knob)} must be <= '
                        f'controller.{bound}={getattr(self, bound)}')


@dataclasses.dataclass(frozen=True)
class PolicyState:
  """A generation's facts (fixed) and the policy's running state (`observed`)."""

  config: ControllerConfig
  batch: int
  tiers: Tuple[int, ...]
  payable: Tuple[int, ...]      # tiers that could beat AR (`CostTable.payable`)
  exact: bool
  retrospective: bool
  bursty: bool                  # retrospective evidence of a host drafter (judged on its
                                # last lengths, short tier-0 chunks first)
  cheap: bool
  carried: bool                 # a pooled prior carried from an earlier generation
  live_B: np.ndarray
  remaining_B: np.ndarray       # tokens each row may still commit
  probe_every: int
  idle: int = 0                 # tier-0 steps since the last probe or positive tier
  chunks: int = 0               # chunks run so far
  prev: Optional[int] = None    # the last chunk's tier ...
  chunk: int = 0                # ... and length
  shadowed: int = 0             # shadow samples seen (per row, at most)
  probed: Optional[float] = None   # after a probe: the best payable tier's score over AR's
  realised: Tuple[Tuple[int, float], ...] = ()   # tier -> EMA of realised / predicted
  depths: Tuple[Tuple[int, int], ...] = ()      # tier -> drafts a step can accept (tree
                                                # tiers: the tree's depth; else the tier)

  @classmethod
  def start(cls, config: ControllerConfig, costs, batch: int, tiers, *, exact: bool,
            retrospective: bool, carried: bool, live_B, remaining_B,
            probe_every: Optional[int] = None,
            depths: Optional[Dict[int, int]] = None, bursty: bool = False) -> 'PolicyState':
    """The state before a generation's first chunk (`costs` has this batch size);
    `depths`: tier -> drafts a step of it can accept, where that is not the tier (a tree
    tier g verifies g drafted nodes, at most its depth of them on one path)."""
    payable = costs.payable(batch, tiers, config.margin, depths)
    cheap = bool(payable) and exact and (retrospective or costs.propose[batch] <= (
        config.shadow_budget * config.steps_per_decision * costs[batch, 0]))
    return cls(config, batch, tuple(tiers), payable, exact, exact and retrospective,
               exact and retrospective and bursty, cheap, carried, np.asarray(live_B), np.asarray(remaining_B),
               probe_every or config.probe_every, chunk=config.steps_per_decision,
               depths=tuple(sorted((depths or {}).items())))

  def depth(self, g: int) -> int:
    """Drafts a step at tier g can accept."""
    return dict(self.depths).get(g, g)

  @property
  def max_gamma(self) -> int:
    """The most drafts a step can accept (a shadow proposal's length)."""
    return max(self.depth(g) for g in self.tiers)

  @property
  def shadow_probe(self) -> bool:
    return self.exact and self.config.shadow_probes

  def ratio(self, g: int) -> float:
    return dict(self.realised).get(g, 1.0)

  def observed(self, decision: 'Decision', committed: int, steps: int, live_B,
               remaining_B, shadow_samples: int = 0, shadow_accepted=()) -> 'PolicyState':
    """The state after `decision`'s chunk ran `steps` row-steps and committed `committed`
    tokens: a positive tier's realised / predicted tokens (capped at 1) averaged into its
    ratio, which corrects estimates that lag behind a row leaving a repetitive stretch.
    On a tier-0 chunk the shadow samples (`shadow_accepted`: leading drafts each matched)
    stand in for what each tier would have realised (samples matching every draft clear
    it): a ratio recovers as soon as fresh evidence says the tier pays again, and stays low
    while it does not."""
    realised = dict(self.realised)
    g = decision.tier
    if g and steps:
      per_row = decision.predicted[g] / self.ratio(g) * steps / max(np.sum(self.live_B), 1)
      realised[g] = 0.5 * (self.ratio(g) + min(committed / per_row, 1.0))
    elif not g and len(shadow_accepted):
      live = max(np.sum(self.live_B), 1)
      for t, r in self.realised:
        per_row = decision.predicted[t] / r / live
        got = np.mean(1 + np.minimum(shadow_accepted, self.depth(t)))
        every_draft = np.all(np.asarray(shadow_accepted) >= self.depth(t))
        realised[t] = 1.0 if every_draft else 0.5 * (r + min(got / per_row, 1.0))
    return dataclasses.replace(
        self, live_B=np.asarray(live_B), remaining_B=np.asarray(remaining_B),
        shadowed=self.shadowed + shadow_samples, realised=tuple(sorted(realised.items())))


@dataclasses.dataclass(frozen=True)
class Decision:
  """The next chunk: `tier`, `chunk` steps, whether it is a `probe`, whether a `shadow`
  proposal is judged against it, whether it runs `plain_ar` steps; `predicted` tokens per
  step of each tier; `state`: the policy's state once it is decided."""

  tier: int
  chunk: int
  probe: bool
  shadow: bool
  plain_ar: bool
  predicted: Dict[int, float]
  state: PolicyState


def predicted_tokens(estimate, state: PolicyState) -> Dict[int, float]:
  """{tier: expected committed tokens per step}, each scaled by its realised ratio."""
  alpha, rate = estimate.conditional(), estimate.proposal_rate()
  return {g: expected_tokens(alpha, state.depth(g), state.live_B, state.remaining_B, rate) *
          state.ratio(g) for g in state.tiers}


def scores(estimate, costs, state: PolicyState) -> Dict[int, float]:
  """{tier: predicted rate}: committed tokens/s ('throughput'), or the inverse of the
  time until the last live row is done if the tier were kept ('makespan': in a static
  batch the slowest row sets the finish time and rows done early idle in the shape)."""
  alpha, rate = estimate.conditional(), estimate.proposal_rate()
  cost = {g: costs.step_cost(state.batch, g, rate, state.live_B) for g in state.tiers}
  if state.config.objective == 'throughput':
    tokens = predicted_tokens(estimate, state)
    return {g: tokens[g] / cost[g] for g in state.tiers}
  out = {}
  for g in state.tiers:
    per_step_B = row_tokens(alpha, state.depth(g), rate) * state.ratio(g)
    steps = np.max(np.where(state.live_B, np.ceil(state.remaining_B / per_step_B), 0.0))
    out[g] = 1.0 / max(steps * cost[g], 1e-12)
  return out


def choose(tier_scores: Dict[int, float], payable, margin: float) -> int:
  """The best of the `payable` tiers; AR unless it beats AR by `margin` (the estimates
  are noisy: near-ties are not worth leaving the AR floor for)."""
  best = max(payable, key=tier_scores.get, default=0)
  return best if best and tier_scores[best] >= (1.0 + margin) * tier_scores[0] else 0


def decide(estimate, costs, state: PolicyState) -> Decision:
  """The next chunk's `Decision` (module docstring)."""
  cfg, b = state.config, state.batch
  predicted = predicted_tokens(estimate, state)
  tier_scores = scores(estimate, costs, state)
  g = choose(tier_scores, state.payable, cfg.margin)
  best = max((tier_scores[t] for t in state.payable), default=0.0) / max(tier_scores[0], 1e-12)
  idle, probe_every = state.idle, state.probe_every
  if state.probed is not None and not g and best <= state.probed:
    # A probe that did not raise the best tier's prospect doubles the interval (back-off
    # while probes find nothing); one that raised it is repeated as soon.
    probe_every = min(2 * probe_every, cfg.max_probe_every)
  first_look = state.chunks == 0 and g > 0 and (state.cheap or state.shadow_probe) and not (
      state.retrospective or state.carried)
  probing = (first_look and not state.cheap) or (
      not g and bool(state.payable) and not state.cheap and idle >= probe_every)
  if first_look:
    g = 0
  elif probing:
    idle = 0
    g = 0 if state.shadow_probe else min(t for t in state.tiers if t > 0)
  elif g:
    idle, probe_every = 0, cfg.probe_every
  remaining = int(np.max(state.remaining_B))
  if probing and g == 0:   # a shadow probe judges every position: max_gamma + 1 tokens
    chunk = max(cfg.steps_per_decision, state.max_gamma + 1)
  elif g == 0 and not state.cheap:   # no evidence before the next probe: run until due
    chunk = probe_every - idle if state.payable else remaining
  elif g == 0 and state.retrospective:
    # Judged in retrospect (its last lengths: the verdict is about now), a tier-0 chunk of
    # any length is evidence, and running AR loses nothing but the speedup not taken: long
    # chunks (x4 in steps and in time). A host drafter's paying stretches come in bursts
    # (a repeated passage): its chunks start short and double while nothing pays.
    long = max(min(4 * cfg.max_steps_per_decision, int(4 * cfg.chunk_seconds / costs[b, 0])),
               cfg.steps_per_decision)
    chunk = long if not state.bursty else min(
        2 * state.chunk if state.prev == 0 else 2 * cfg.steps_per_decision, long)
  else:
    # Growing chunks amortise host syncs (x4 at tier 0, where nothing is verified); with
    # shadow drafts the first tier-0 chunks stay short: each is one sample.
    grow = g == state.prev and not probing and (g > 0 or state.shadowed >= cfg.shadow_warmup)
    cap = min(cfg.max_steps_per_decision, int(cfg.chunk_seconds / costs[b, g]))
    chunk = max(min((4 if g == 0 else 2) * state.chunk, cap), cfg.steps_per_decision) \
        if grow else cfg.steps_per_decision
  shadow = (state.cheap and state.depth(g) < state.max_gamma) or (probing and g == 0)
  # Plain AR when nothing will be proposed before the batch ends: no tier can pay, or
  # this tier-0 chunk runs to the end with no probe or shadow draft after it.
  plain_ar = not state.payable or (g == 0 and not state.cheap and chunk >= remaining)
  after = dataclasses.replace(state, idle=idle + (chunk if g == 0 else 0),
                              probe_every=probe_every, chunks=state.chunks + 1, prev=g,
                              chunk=chunk, probed=best if probing else None)
  return Decision(g, chunk, probing, shadow, plain_ar, predicted, after)
