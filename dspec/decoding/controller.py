"""Load-aware verify-length controller: per decision, pick γ from a few compiled tiers.

Speculation pays at low load and costs at high load: a verify of γ+1 tokens per row is
nearly free when decoding is memory-bound (batch 1) and costs ~γ+1 times an AR step once
it is compute-bound (large batch, CPU). Following SGLang's adaptive mode (one compiled
program per tier) and DSpark's load-aware scheduler (maximise τ × steps/s), the
controller keeps

  * an online estimate of the conditional acceptance α_rj of draft position j for every
    row r, given a proposal (EMA of the engine's per-row accepted-count histogram, shrunk
    towards the pooled batch estimate; positions never verified yet take the last
    verified one's value), and of the rate π_r at which row r proposes at all (an n-gram
    miss proposes nothing; 1 before any evidence);
  * a step-cost table cost(B, γ) in seconds, profiled at start-up by timing each tier's
    drafting step on the real state (`force_wide`: verified at full width even where the
    drafter proposes nothing), or loaded from a JSON file written by `CostTable.save`;

and before every decision chooses the tier maximising expected committed tokens per second

  E(γ) = Σ_{live r} min(1 + π_r Σ_{k≤γ} Π_{j≤k} α_rj, remaining_r) / c(B, γ),

where a step costs c(B, γ) = P·cost(B, γ) + (1 - P)·(cost(B, 0) + proposal) with P =
1 - Π_{live r} (1 - π_r) the chance that some row drafts (else the engine runs the anchor
alone, an AR step),

staying at AR unless the best tier beats it by `margin` (estimates are noisy; near-ties
are not worth leaving the AR floor for). Each tier's prediction is also scaled by an EMA
of its realised / predicted committed tokens (capped at 1), which corrects acceptance
estimates that lag behind a row leaving a repetitive stretch. `objective='makespan'` scores
a tier instead by the time until the last live row would finish (static batches, where
rows done early idle in the shape); the default maximises throughput as above.

Tier 0 is plain AR: the drafter proposes nothing and `idle_update`s its state (MTP,
EAGLE-3 and the DFlash family only record the target's features, and catch their caches up
when a positive tier or a shadow proposal next needs them; a shadow proposal's caught-up
state is kept). Every tier runs the same verified speculative step, so the output is
lossless by construction: greedy output equals AR, token for token. Acceptance is also
learnt while verifying less than the largest tier, or nothing: when the largest tier's
proposal is cheap (oracle: profiled, under `shadow_budget` of a chunk) it is made before
each chunk and compared with the tokens the chunk commits ("shadow" drafts, never
verified). A drafter whose proposal is a function of the committed tokens alone (n-gram:
`propose_from_tokens`) is instead judged in retrospect, in one device call after each
chunk: its proposal at every length the chunk committed, matched against what followed,
along the walk a verifying tier would have taken. That judges every position, so its
tier-0 chunks run long (4 × `chunk_seconds`: AR loses nothing but the speedup not taken),
and the prompt is judged so before the first step. Before any evidence, where shadow
evidence is available, the first chunk runs tier 0 with one rather than verifying a tier
on the prior. Costly drafters probe every `probe_every` steps at tier 0 (the interval
doubles while probes do not pay): with one shadow proposal where its evidence is exact
(greedy decoding, or a drafter proposing tokens rather than samples: a shadow match then
has the probability a verification would accept), which costs one draft pass and measures
every position; else (a sampling drafter at T > 0, where a sample matches the target's
sample less often than rejection sampling accepts it) by verifying the smallest positive
tier for a few steps (the cheapest verified evidence; deeper positions take position 1's
estimate). The probe interval of a batch size carries over to the next generation, as a
server's adaptive state does: a drafter that did not pay is probed rarely until a probe
pays again; so does the batch's pooled acceptance and proposal rate, the next generation's
prior (which then needs no first look). Tiers that could not beat AR even if every draft
were accepted, (γ+1)/cost(B, γ) < (1 + margin) / cost(B, 0), are never chosen or probed;
when none can, or when a tier-0 chunk will run to the end of the batch with no probe due,
the batch runs plain AR steps (no proposals, no target taps, no drafter update).

Each decision runs `steps_per_decision` steps inside one jitted `lax.while_loop` and reads
the counters back once; while the chosen tier is unchanged the chunk grows (x2, x4 at AR
with shadow drafts after `shadow_warmup` samples; up to `max_steps_per_decision` steps and
`chunk_seconds` of profiled device time, which bounds the cost of a wrong choice) to
amortise the host round trip. At tier 0 without per-chunk shadow drafts no evidence
arrives before the next probe, so one chunk runs until it is due. Drafters
are rebuilt per tier with `drafter.with_num_draft(γ)`; when the rebuilt drafter's state
differs from the largest tier's (MTP caches one layer per depth) the largest tier's
drafter is used with its proposal truncated to γ (`TruncatedDrafter`). A drafter with
`set_verify_cost` (DSpark's per-row verify lengths) gets λ(B) = `CostTable.verify_cost`, the
marginal cost of one more verified draft at this batch size, in its state.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspec import files
from dspec.decoding.drafter import NoDrafter, TruncatedDrafter
from dspec.decoding.engine import SpeculativeEngine
from dspec.sampling import SamplingSpec


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
  """Knobs of the controller (hashable)."""

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

  def __post_init__(self):
    if not self.tiers or sorted(set(self.tiers)) != list(self.tiers) or self.tiers[0] < 0:
      raise ValueError(f'controller tiers must be sorted, distinct and >= 0, got {self.tiers}')
    if not 0.0 <= self.ema < 1.0 or not 0.0 < self.prior <= 1.0:
      raise ValueError(f'controller needs 0 <= ema < 1 and 0 < prior <= 1, got '
                       f'{self.ema}, {self.prior}')
    if self.steps_per_decision < 1 or self.max_steps_per_decision < self.steps_per_decision:
      raise ValueError('controller needs 1 <= steps_per_decision <= max_steps_per_decision')
    if self.objective not in ('makespan', 'throughput'):
      raise ValueError(f'controller objective must be makespan or throughput, got '
                       f'{self.objective!r}')


# ---------------------------------------------------------------------------- tiers

def tier_drafter(drafter, gamma: int):
  """`drafter` proposing `gamma` tokens: its proposal truncated (tier 0, and drafters that
  draft a whole block in one pass), else `with_num_draft`; None when it cannot."""
  if gamma == 0 or (drafter.truncate_for_tiers and gamma <= drafter.num_draft):
    return TruncatedDrafter(drafter, gamma)
  try:
    return drafter.with_num_draft(gamma)
  except ValueError:
    return None


# ------------------------------------------------------------------------ cost table

class CostTable:
  """Seconds per engine step for each (batch size, tier); JSON round-trips."""

  def __init__(self, costs: Optional[Dict[Tuple[int, int], float]] = None,
               propose: Optional[Dict[int, float]] = None, meta=None):
    self.costs = dict(costs or {})
    self.propose = dict(propose or {})   # batch -> seconds of the largest tier's proposal
    self.meta = dict(meta or {})

  def has(self, batch: int, tiers) -> bool:
    return batch in self.propose and all((batch, g) in self.costs for g in tiers)

  def __getitem__(self, key) -> float:
    return self.costs[key]

  def verify_cost(self, batch: int, tiers) -> float:
    """λ(B) of cost(B, γ) ≈ c0·(1 + λ·γ): least squares over `tiers`, clipped at 0; tier 0
    counts with the proposal's cost (every positive tier drafts), so c0 includes the draft
    pass. The marginal cost of one more verified draft relative to the fixed cost: DSpark's
    per-row verify-length rule (`drafters/dspark.py`)."""
    gammas = np.array(sorted(tiers), np.float64)
    costs = np.array([self[batch, int(g)] + (self.propose.get(batch, 0.0) if g == 0 else 0.0)
                      for g in gammas])
    slope, c0 = np.polyfit(gammas, costs, 1)
    c0 = c0 if c0 > 0 else costs.min()
    return max(float(slope / c0), 0.0)

  def save(self, path: str) -> None:
    rows = {}
    for (b, g), c in sorted(self.costs.items()):
      rows.setdefault(str(b), {})[str(g)] = c
    files.write_json_atomic(path, {
        'seconds_per_step': rows, 'meta': self.meta,
        'propose_seconds': {str(b): c for b, c in sorted(self.propose.items())}})

  @classmethod
  def load(cls, path: str) -> 'CostTable':
    try:
      with open(path) as f:
        data = json.load(f)
      costs = {(int(b), int(g)): float(c)
               for b, row in data['seconds_per_step'].items() for g, c in row.items()}
      propose = {int(b): float(c) for b, c in data.get('propose_seconds', {}).items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
      raise ValueError(f'bad step-cost table {path}: {e}') from e
    return cls(costs, propose, data.get('meta'))


# ------------------------------------------------------------------ acceptance model

class AcceptanceEstimate:
  """Per-row EMA counts of conditional acceptance at draft positions 1..G, given a
  proposal, and of how often a row proposes at all (an n-gram miss proposes nothing)."""

  def __init__(self, batch: int, max_gamma: int, cfg: ControllerConfig, carried=None):
    """`carried`: (α_G, π) pooled at the end of an earlier generation, the prior in place
    of (cfg.prior, 1)."""
    self.cfg = cfg
    self.carried = carried
    self.num_BG = np.zeros((batch, max_gamma))
    self.den_BG = np.zeros((batch, max_gamma))
    self.proposing_B = np.zeros(batch)   # steps with a proposal ...
    self.steps_B = np.zeros(batch)       # ... out of steps observed

  def _add(self, num_BG, den_BG, proposing_B, steps_B) -> None:
    """EMA update of the positions (and rows) that got evidence; others keep theirs."""
    g = num_BG.shape[1]
    decay = np.where(den_BG > 0, self.cfg.ema, 1.0)
    self.num_BG[:, :g] = decay * self.num_BG[:, :g] + num_BG
    self.den_BG[:, :g] = decay * self.den_BG[:, :g] + den_BG
    decay = np.where(steps_B > 0, self.cfg.ema, 1.0)
    self.proposing_B = decay * self.proposing_B + proposing_B
    self.steps_B = decay * self.steps_B + steps_B

  def observe(self, delta_hist_BG1: np.ndarray, proposing_B: np.ndarray, gamma: int) -> None:
    """Adds the accepted-count histogram of steps run at tier `gamma`, of which
    `proposing_B` had a proposal (the others accepted nothing for want of one)."""
    if gamma == 0:
      return
    h = delta_hist_BG1[:, :gamma + 1].astype(np.float64)
    steps_B = h.sum(axis=1)
    h[:, 0] -= steps_B - proposing_B                          # steps that proposed nothing
    at_least = np.cumsum(h[:, ::-1], axis=1)[:, ::-1]         # [B, γ+1]: steps with n >= j
    self._add(at_least[:, 1:], at_least[:, :-1], proposing_B, steps_B)

  def observe_shadow(self, accepted_BS: np.ndarray, judged_BS: np.ndarray,
                     proposed_BS: np.ndarray) -> None:
    """Adds S unverified proposals per row (as one observation): `accepted_BS` leading
    drafts matched the committed tokens, out of `judged_BS` comparable positions (0: no
    sample), `proposed_BS` whether there was a proposal at all."""
    j = np.arange(1, self.num_BG.shape[1] + 1)[None, None, :]
    sampled = judged_BS > 0
    judged = (j <= judged_BS[..., None]) & (proposed_BS & sampled)[..., None]
    self._add(np.sum(judged & (accepted_BS[..., None] >= j), axis=1, dtype=np.float64),
              np.sum(judged & (accepted_BS[..., None] >= j - 1), axis=1, dtype=np.float64),
              np.sum(proposed_BS & sampled, axis=1, dtype=np.float64),
              np.sum(sampled, axis=1, dtype=np.float64))

  def pooled(self):
    """(α_G, π) of the whole batch: the prior where unseen (without a carried prior,
    positions past the last verified one take its value)."""
    w = self.cfg.prior_weight
    prior_alpha, prior_rate = self.carried or (self.cfg.prior, 1.0)
    pool_den = self.den_BG.sum(0)
    alpha = (self.num_BG.sum(0) + w * prior_alpha) / (pool_den + w)
    seen = np.nonzero(pool_den > 0)[0]
    if len(seen) and self.carried is None:
      alpha[seen[-1] + 1:] = alpha[seen[-1]]
    return alpha, (self.proposing_B.sum() + w * prior_rate) / (self.steps_B.sum() + w)

  def conditional(self) -> np.ndarray:
    """α_rj [B, G]: row counts shrunk to the pooled estimate."""
    return (self.num_BG + self.cfg.prior_weight * self.pooled()[0]) / (
        self.den_BG + self.cfg.prior_weight)

  def proposal_rate(self) -> np.ndarray:
    """π_r [B]: the fraction of steps in which row r proposes, shrunk to the pooled rate
    (1 before any evidence: a drafter is assumed to draft, and its steps to cost so)."""
    w = self.cfg.prior_weight
    return (self.proposing_B + w * self.pooled()[1]) / (self.steps_B + w)


def expected_tokens(alpha_BG: np.ndarray, gamma: int, live_B: np.ndarray,
                    remaining_B: np.ndarray, rate_B=1.0) -> float:
  """Σ_{live r} min(1 + π_r Σ_{k≤γ} Π_{j≤k} α_rj, remaining_r)."""
  return float(np.sum(np.minimum(row_tokens(alpha_BG, gamma, rate_B), remaining_B) * live_B))


def row_tokens(alpha_BG: np.ndarray, gamma: int, rate_B=1.0) -> np.ndarray:
  """Expected tokens per step of each row at tier γ: 1 + π_r Σ_{k≤γ} Π_{j≤k} α_rj."""
  return 1.0 + rate_B * np.cumprod(alpha_BG[:, :gamma], axis=1).sum(axis=1)


# ------------------------------------------------------------------------ controller

def _shadow_fn(engine: SpeculativeEngine, target_params, drafter_params, state):
  """What the largest tier would propose now, ((tokens [B, G], count [B], start [B]),
  the drafter state synced for it: the next steps record from there)."""
  target = nnx.merge(engine.target_graphdef, target_params)
  ctx = engine.context(state)
  dstate = engine.drafter.sync(drafter_params, state.drafter_state, target, ctx)
  p = engine.drafter.propose(drafter_params, dstate, target, ctx, jax.random.key(0))
  return (p.tokens_BG, p.num_proposed_B, state.num_tokens_B), dstate


def _match_committed(tokens_BL, num_tokens_B, draft_BG, num_proposed_B, start_B):
  """(leading drafts equal to the tokens committed from `start_B` on, positions comparable)."""
  b, g = draft_BG.shape
  j = jnp.arange(g)[None, :]
  committed_BG = tokens_BL[jnp.arange(b)[:, None],
                           jnp.clip(start_B[:, None] + j, 0, tokens_BL.shape[1] - 1)]
  judged_B = jnp.clip(num_tokens_B - start_B, 0, g)
  ok = (committed_BG == draft_BG) & (j < num_proposed_B[:, None]) & (j < judged_B[:, None])
  return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1), judged_B


@jax.jit
def _shadow_match(tokens_BL, num_tokens_B, draft_BG, num_proposed_B, start_B):
  """`_match_committed`, and whether each row proposed at all: [B, 1] samples."""
  accepted_B, judged_B = _match_committed(tokens_BL, num_tokens_B, draft_BG, num_proposed_B,
                                          start_B)
  return accepted_B[:, None], judged_B[:, None], (num_proposed_B > 0)[:, None]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _retrospective_match(drafter, width: int, tokens_BL, start_B, end_B):
  """Shadow samples [B, width] of `drafter` (one with `propose_from_tokens`) judged after
  the fact: what it would have proposed after each length start_B .. end_B - 1 (at most
  `width`), matched against the tokens committed since, along the walk a tier verifying
  every proposal would have taken (each step advances accepted + 1 tokens). Returns
  (accepted, judged, proposed) for `AcceptanceEstimate.observe_shadow`; judged is 0 past a
  row's walk."""

  def at(offset):
    length_B = start_B + offset
    p = drafter.propose_from_tokens(tokens_BL, length_B)
    accepted_B, judged_B = _match_committed(tokens_BL, end_B, p.tokens_BG, p.num_proposed_B,
                                            length_B)
    return accepted_B, judged_B, p.num_proposed_B > 0

  accepted_BW, judged_BW, proposed_BW = jax.vmap(at, out_axes=1)(
      jnp.arange(width, dtype=jnp.int32))
  rows = jnp.arange(tokens_BL.shape[0])

  def step(s, carry):
    at_B, samples = carry
    i_B = jnp.minimum(at_B, width - 1)
    live_B = (at_B < width) & (judged_BW[rows, i_B] > 0)
    sample = (accepted_BW[rows, i_B], judged_BW[rows, i_B], proposed_BW[rows, i_B])
    samples = tuple(out.at[:, s].set(jnp.where(live_B, x, jnp.zeros_like(x)))
                    for out, x in zip(samples, sample))
    return jnp.where(live_B, at_B + sample[0] + 1, width), samples

  zeros = jnp.zeros_like(judged_BW)
  return jax.lax.fori_loop(0, width, step, (jnp.zeros_like(start_B), (
      zeros, zeros, zeros.astype(bool))))[1]


class VerifyLengthController:
  """Drop-in for a SpeculativeEngine in `runner.run_generation`: `prefill` then
  `generate`, which chooses a tier per decision. `last_trace` lists (tier, steps, s)."""

  def __init__(self, target_graphdef, drafter, *, sampling: SamplingSpec = SamplingSpec(),
               stop_ids: Tuple[int, ...] = (), config: ControllerConfig = ControllerConfig(),
               cost_table: Optional[CostTable] = None, trace: bool = False):
    self.config = config
    self.drafter = drafter
    self.costs = cost_table or CostTable()
    tiers = {}
    for g in config.tiers:
      d = tier_drafter(drafter, g)
      if d is not None:
        tiers[g] = d
    if len(tiers) < 2 or 0 not in tiers:
      raise ValueError(f'controller: drafter {type(drafter).__name__} supports too few of '
                       f'the tiers {config.tiers} (need 0 and one positive tier)')
    self.max_gamma = max(tiers)
    self._make = lambda d: SpeculativeEngine(target_graphdef, drafter=d, sampling=sampling,
                                             stop_ids=stop_ids, trace=trace)
    self._set_engines({g: self._make(d) for g, d in tiers.items()})
    self.last_trace = []
    self.row0_tiers = []    # the tier of each of row 0's verify steps (last `generate`)
    self._checked = False
    self._realised = {}     # tier -> EMA of realised / predicted tokens (<= 1)
    self._probe_every = {}  # batch size -> tier-0 probe interval, kept across generations
    self._carried = {}      # batch size -> pooled (α_G, π) at the end of the last one

  def _set_engines(self, engines):
    """Engines per tier (each runs its chunks through `engine.run`) and the jitted shadow
    proposal of the largest tier."""
    self.engines = engines
    self._shadow = jax.jit(functools.partial(_shadow_fn, engines[self.max_gamma]))
    # No tier can pay at this batch size: plain AR steps, no taps and no drafter update
    # (nothing will be proposed for the rest of the generation).
    self._plain_ar = engines[0].with_drafter(NoDrafter())

  @property
  def tiers(self) -> Tuple[int, ...]:
    return tuple(sorted(self.engines))

  @property
  def num_draft(self) -> int:
    return self.max_gamma

  @property
  def sampling(self) -> SamplingSpec:
    return self.engines[0].sampling

  def buffer_len(self, prompt_len: int, max_new_tokens: int) -> int:
    return self.engines[self.max_gamma].buffer_len(prompt_len, max_new_tokens)

  # --------------------------------------------------------------------- set-up

  def prefill(self, target_params, drafter_params, prompt_BP, prompt_len_B, **kw):
    """The largest tier's prefill, with stats wide enough for every tier."""
    state = self.engines[self.max_gamma].prefill(target_params, drafter_params, prompt_BP,
                                                 prompt_len_B, **kw)
    if not self._checked:
      self._share_state(target_params, drafter_params, prompt_BP.shape, state)
    return state

  def _share_state(self, target_params, drafter_params, prompt_shape, state):
    """Tiers whose rebuilt drafter keeps a different state truncate the largest one."""
    ref = self.engines[self.max_gamma].drafter
    engines = dict(self.engines)
    for g, engine in self.engines.items():
      if g not in (0, self.max_gamma) and not _same_state(
          engine, target_params, drafter_params, prompt_shape, state):
        engines[g] = self._make(TruncatedDrafter(ref, g))
    engines[0] = self._make(TruncatedDrafter(ref, 0))
    self._set_engines(engines)
    self._checked = True

  def profile(self, target_params, drafter_params, state) -> CostTable:
    """Times every tier's step on copies of `state` (compiling first), and the largest
    tier's proposal alone; fills the table. Positive tiers verify their full width even
    where the drafter proposes nothing (`force_wide`): the table holds what a drafting step
    costs, and `step_cost` what a step costs given how often rows propose."""
    b = state.tokens_BL.shape[0]
    steps = self.config.profile_steps
    propose = lambda: self._shadow(target_params, drafter_params, state)
    jax.block_until_ready(propose())
    t0 = time.perf_counter()
    jax.block_until_ready([propose() for _ in range(self.config.profile_steps)])
    self.costs.propose[b] = (time.perf_counter() - t0) / self.config.profile_steps
    # Compiled here, not in the first generation that runs plain AR to the end.
    jax.block_until_ready(self._plain_ar.run(target_params, drafter_params,
                                             jax.tree.map(lambda x: x.copy(), state), 1))
    best = {}
    for r in range(self.config.profile_repeats + 1):   # round 0 compiles; rounds
      for g in self.tiers:                             # interleave tiers against drift
        copy = jax.tree.map(lambda x: x.copy(), state)
        t0 = time.perf_counter()
        out = self.engines[g].run(target_params, drafter_params, copy, steps,
                                  force_wide=g > 0)
        done = max(int(jax.device_get(out.step) - jax.device_get(state.step)), 1)
        if r:
          best[g] = min(best.get(g, float('inf')), (time.perf_counter() - t0) / done)
    self.costs.costs.update({(b, g): c for g, c in best.items()})
    self.costs.meta.update(buffer_len=int(state.tokens_BL.shape[1]))
    return self.costs

  # --------------------------------------------------------------------- decoding

  def predicted(self, estimate: AcceptanceEstimate, batch: int, live_B, remaining_B):
    """{tier: expected tokens per step}, each scaled by the tier's realised/predicted ratio."""
    alpha, rate = estimate.conditional(), estimate.proposal_rate()
    return {g: expected_tokens(alpha, g, live_B, remaining_B, rate) *
            self._realised.get(g, 1.0) for g in self.tiers}

  def step_cost(self, batch: int, g: int, rate_B, live_B) -> float:
    """Expected seconds per step at tier g: the drafting step's cost when some live row
    proposes (probability 1 - Π_r (1 - π_r), π = `rate_B`), else the anchor-only
    forward's, an AR step plus the proposal (an n-gram miss verifies nothing)."""
    ar = self.costs[batch, 0]
    if g == 0:
      return ar
    idle = np.prod(np.where(live_B, 1.0 - rate_B, 1.0))
    drafting = max(self.costs[batch, g], ar)   # a profile below AR's is timing noise
    anchor_only = min(ar + self.costs.propose.get(batch, 0.0), drafting)
    return (1.0 - idle) * drafting + idle * anchor_only

  def scores(self, estimate: AcceptanceEstimate, batch: int, live_B, remaining_B) -> dict:
    """{tier: predicted rate}: committed tokens/s ('throughput'), or the inverse of the
    time until the last live row is done if the tier were kept ('makespan': in a static
    batch the slowest row sets the finish time and rows done early idle in the shape)."""
    alpha, rate = estimate.conditional(), estimate.proposal_rate()
    cost = {g: self.step_cost(batch, g, rate, live_B) for g in self.tiers}
    if self.config.objective == 'throughput':
      tokens = self.predicted(estimate, batch, live_B, remaining_B)
      return {g: tokens[g] / cost[g] for g in self.tiers}
    out = {}
    for g in self.tiers:
      per_step_B = row_tokens(alpha, g, rate) * self._realised.get(g, 1.0)
      steps = np.max(np.where(live_B, np.ceil(remaining_B / per_step_B), 0.0))
      out[g] = 1.0 / max(steps * cost[g], 1e-12)
    return out

  def choose(self, scores: dict, payable) -> int:
    """The best of the `payable` tiers; AR unless it beats AR by `margin` (the estimates
    are noisy: near-ties are not worth leaving the AR floor for)."""
    best = max(payable, key=scores.get, default=0)
    return best if best and scores[best] >= (1.0 + self.config.margin) * scores[0] else 0

  def payable(self, batch: int) -> list:
    """Positive tiers that would beat AR by `margin` if every draft were accepted."""
    floor = (1.0 + self.config.margin) / self.costs[batch, 0]
    return [g for g in self.tiers if g and (g + 1) / self.costs[batch, g] >= floor]

  def generate(self, target_params, drafter_params, state):
    """Runs chunks of steps until every row is done, re-choosing the tier each time.

    Shadow proposals of the largest tier (compared with the tokens the chunk then commits)
    come before every chunk when cheap (`shadow_budget`), else as tier 0's probe where
    exact; otherwise tier 0 probes by verifying the smallest positive tier.
    """
    cfg = self.config
    b = state.tokens_BL.shape[0]
    if not self.costs.has(b, self.tiers):
      self.profile(target_params, drafter_params, state)
    set_verify_cost = getattr(self.drafter, 'set_verify_cost', None)
    if set_verify_cost is not None:   # load-aware verify lengths (DSpark): λ(B) of the table
      state = state.replace(drafter_state=set_verify_cost(
          state.drafter_state, self.costs.verify_cost(b, self.tiers)))
    payable = self.payable(b)
    exact = self.engines[0].sampling.greedy or not self.drafter.samples_proposals
    # Drafters proposing from the tokens alone (n-gram) are judged after each chunk at every
    # length it committed, as a tier verifying them would have walked (one device call).
    retrospective = exact and hasattr(self.drafter, 'propose_from_tokens')
    cheap = bool(payable) and exact and (retrospective or self.costs.propose[b] <= (
        cfg.shadow_budget * cfg.steps_per_decision * self.costs[b, 0]))
    shadow_probe = exact and cfg.shadow_probes
    positive = min(g for g in self.tiers if g > 0)
    carried = self._carried.get(b)
    estimate = AcceptanceEstimate(b, self.max_gamma, cfg, carried)
    hist, reached, done, num, prompt_len, max_new, steps_B = jax.device_get((
        state.stats.accept_hist_BG1, state.stats.reached_BG, state.done_B,
        state.num_tokens_B, state.prompt_len_B, state.max_new_tokens, state.stats.steps_B))
    proposing = reached[:, 0]   # steps that verified a draft at position 1
    row0_steps = steps_B[0]
    self.row0_tiers = []
    trace, prev, chunk = [], None, cfg.steps_per_decision
    idle, probe_every, shadowed = 0, self._probe_every.get(b, cfg.probe_every), 0
    self._realised = {}
    if retrospective and cheap:   # first, the drafter judged on the prompt's own text
      estimate.observe_shadow(*self._judge_in_retrospect(state, np.zeros_like(num), num))
    while not done.all():
      remaining = max_new - (num - prompt_len)
      tokens = self.predicted(estimate, b, ~done, remaining)
      g = self.choose(self.scores(estimate, b, ~done, remaining), payable)
      # Before any evidence, learn from a shadow proposal rather than verify on the prior.
      first_look = not trace and g > 0 and (cheap or shadow_probe) and not (
          retrospective or carried)
      probing = (first_look and not cheap) or (
          not g and bool(payable) and not cheap and idle >= probe_every)
      if first_look:
        g = 0
      elif probing:
        idle, probe_every = 0, min(2 * probe_every, cfg.max_probe_every)
        g = 0 if shadow_probe else positive
      elif g:
        idle, probe_every = 0, cfg.probe_every
      if probing and g == 0:   # a shadow probe judges every position: max_gamma + 1 tokens
        chunk = max(cfg.steps_per_decision, self.max_gamma + 1)
      elif g == 0 and not cheap:   # no evidence before the next probe: run until it is due
        chunk = probe_every - idle if payable else int(remaining.max())
      else:
        # Growing chunks amortise host syncs (x4 at tier 0, where nothing is verified);
        # with shadow drafts the first tier-0 chunks stay short: each is one sample.
        grow = g == prev and not probing and (g > 0 or shadowed >= cfg.shadow_warmup)
        cap = min(cfg.max_steps_per_decision, int(cfg.chunk_seconds / self.costs[b, g]))
        chunk = max(min((4 if g == 0 else 2) * chunk, cap), cfg.steps_per_decision) \
            if grow else cfg.steps_per_decision
        if g == 0 and retrospective:
          # Judged in retrospect (its last `max_steps_per_decision` lengths: the verdict
          # is about now), a tier-0 chunk of any length is evidence, and running AR loses
          # nothing but the speedup not taken: long chunks (x4 in steps and in time).
          chunk = max(min(4 * cfg.max_steps_per_decision,
                          int(4 * cfg.chunk_seconds / self.costs[b, 0])),
                      cfg.steps_per_decision)
      idle += chunk if g == 0 else 0
      t0 = time.perf_counter()
      num_before, done_before = num, done
      shadow_now = (cheap and g < self.max_gamma) or (probing and g == 0)
      matched = None
      if shadow_now and not retrospective:
        proposed, synced = self._shadow(target_params, drafter_params, state)
        state = state.replace(drafter_state=synced)
      # Plain AR steps when nothing will be proposed before the batch ends: no tier can
      # pay, or this tier-0 chunk runs to the end with no probe or shadow draft after it.
      final_ar = g == 0 and not cheap and chunk >= int(remaining.max())
      engine = self.engines[g] if payable and not final_ar else self._plain_ar
      state = engine.run(target_params, drafter_params, state, chunk)
      if shadow_now and not retrospective:
        matched = _shadow_match(state.tokens_BL, state.num_tokens_B, *proposed)
      new_hist, reached, done, num, matched, steps_B = jax.device_get((
          state.stats.accept_hist_BG1, state.stats.reached_BG, state.done_B,
          state.num_tokens_B, matched, state.stats.steps_B))
      new_proposing = reached[:, 0]
      if shadow_now and retrospective and not done.all():
        matched = self._judge_in_retrospect(state, num_before, num)
      new_row0_steps = steps_B[0]
      steps = int(new_hist.sum() - hist.sum())
      self.row0_tiers += [g] * int(new_row0_steps - row0_steps)
      row0_steps = new_row0_steps
      trace.append((g, steps, time.perf_counter() - t0))
      if g and steps:   # realised vs predicted tokens: corrects optimistic estimates
        ratio = float(np.sum(num - num_before)) / (
            tokens[g] / self._realised.get(g, 1.0) * steps / max(np.sum(~done_before), 1))
        self._realised[g] = 0.5 * (self._realised.get(g, 1.0) + min(ratio, 1.0))
      estimate.observe(new_hist - hist, new_proposing - proposing, g)
      if matched is not None:
        estimate.observe_shadow(*matched)
        shadowed += int(np.max(np.sum(matched[1] > 0, axis=1), initial=0))
      hist, proposing, prev = new_hist, new_proposing, g
    self.last_trace = trace
    self._probe_every[b] = probe_every
    self._carried[b] = estimate.pooled()
    return state

  def _judge_in_retrospect(self, state, since_B: np.ndarray, num_B: np.ndarray):
    """Host copies of `_retrospective_match` over the lengths since `since_B`, at most the
    last `max_steps_per_decision` before `num_B` (host copies of the state's counts)."""
    width = self.config.max_steps_per_decision
    return jax.device_get(_retrospective_match(
        self.drafter, width, state.tokens_BL, jax.device_put(np.maximum(since_B, num_B - width)),
        state.num_tokens_B))

  def tier_steps(self) -> dict:
    """{tier: verify steps summed over rows} of the last `generate`."""
    out = {}
    for g, n, _ in self.last_trace:
      out[g] = out.get(g, 0) + n
    return out

  def tier_usage(self) -> dict:
    """{tier: fraction of row-steps} of the last `generate`."""
    total = sum(n for _, n, _ in self.last_trace) or 1
    out = {}
    for g, n, _ in self.last_trace:
      out[g] = out.get(g, 0.0) + n / total
    return out


def _same_state(engine, target_params, drafter_params, prompt_shape, state) -> bool:
  """Whether `engine`'s drafter keeps a state of the same structure and shapes."""
  prompt_BP = jax.ShapeDtypeStruct(prompt_shape, jnp.int32)
  lens_B = jax.ShapeDtypeStruct(state.num_tokens_B.shape, jnp.int32)
  try:
    out = jax.eval_shape(
        lambda p, l: engine.prefill_fn(target_params, drafter_params, p, l, 0.0, 1.0, 1, 0,
                                       buffer_len=state.tokens_BL.shape[1]),
        prompt_BP, lens_B)
  except (ValueError, TypeError):
    return False
  shapes = lambda t: [(x.shape, x.dtype) for x in jax.tree.leaves(t)]
  return (jax.tree.structure(out.drafter_state) == jax.tree.structure(state.drafter_state)
          and shapes(out.drafter_state) == shapes(state.drafter_state))
