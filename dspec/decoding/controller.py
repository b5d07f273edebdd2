"""Load-aware verify-length controller: the I/O around `policy.decide`.

Speculation pays at low load and costs at high load: a verify of γ+1 tokens per row is
nearly free when decoding is memory-bound (batch 1) and costs ~γ+1 times an AR step once
it is compute-bound (large batch, CPU). Following SGLang's adaptive mode (one compiled
program per tier) and DSpark's load-aware scheduler (maximise τ × steps/s), the
controller keeps an `AcceptanceEstimate` (`estimate.py`: per-row EMA of the conditional
acceptance α_rj and of the proposal rate π_r) and a step-cost table (`costs.py`: profiled
at start-up by timing each tier's drafting step on the real state, `force_wide`, or
loaded from JSON), and before every chunk asks `policy.decide` (pure, unit-tested) for
the tier maximising expected committed tokens per second

  E(γ) = Σ_{live r} min(1 + π_r Σ_{k≤γ} Π_{j≤k} α_rj, remaining_r) / c(B, γ),

the chunk's length and the evidence it gathers (`policy.py` lists the modes: shadow
drafts, retrospective judging, first look, probes, growth, plain AR).

Tier 0 is plain AR: the drafter proposes nothing and `idle_update`s its state (MTP,
EAGLE-3 and the DFlash family only record the target's features, and catch their caches up
when a positive tier or a shadow proposal next needs them; a shadow proposal's caught-up
state is kept). Every tier runs the same verified speculative step, so the output is
lossless by construction: greedy output equals AR, token for token. Each chunk runs inside
one jitted `lax.while_loop` and its counters are read back once. The probe interval and
the pooled acceptance of a batch size carry over to the next generation, as a server's
adaptive state does. Drafters are rebuilt per tier with `drafter.with_num_draft(γ)`; when
the rebuilt drafter's state differs from the largest tier's (MTP caches one layer per
depth) the largest tier's drafter is used with its proposal truncated to γ
(`TruncatedDrafter`). The drafter's `set_verify_cost` (DSpark's per-row verify lengths)
gets λ(B) = `CostTable.verify_cost`, the marginal cost of one more verified draft.

With a `TreeConfig` (verify_length 'auto_tree') the positive tiers are node budgets: tier g
verifies a token tree of g drafted nodes (g + 1 with the anchor; `TreeEngine`, one compiled
program per budget) on the full drafter, and accepts at most its depth min(g, num_draft)
of them, which is what E and the payable test count; tier 0 is AR as above. Every tier is
a verified step, so the output stays exact. The estimate's α_j is then the conditional
acceptance at depth j of whatever was verified (the trees' accepted paths, shadow chains at
tier 0), and each budget's realised ratio corrects its prediction.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Optional, Tuple

import jax
import numpy as np

from dspec import distributed
from dspec.compiled_programs import ProgramCache
from dspec.decoding import costs as costs_lib
from dspec.decoding.costs import CostTable
from dspec.decoding.drafter import NoDrafter, TruncatedDrafter
from dspec.decoding.engine import SpeculativeEngine
from dspec.decoding.estimate import (AcceptanceEstimate, retrospective_match, shadow_match,
                                     shadow_proposal)
from dspec.decoding.policy import ControllerConfig, Decision, PolicyState, decide
from dspec.decoding.sharded import ShardedEngine
from dspec.decoding.tiers import same_drafter_state, tier_drafter
from dspec.decoding.tree_engine import TreeConfig, TreeEngine
from dspec.sampling import SamplingSpec


class VerifyLengthController:
  """Drop-in for a SpeculativeEngine in `runner.run_generation`: `prefill` then
  `generate`, which chooses a tier per decision. `last_trace` lists (tier, steps, s).
  With a mesh `placement` every tier's engine is a `ShardedEngine`; with `tree` the
  positive tiers are node budgets (module docstring; one device). `profiled`: tables
  profiled before, by `costs.fingerprint`, read and extended (`_profile_or_load`)."""

  adaptive = True   # the engine protocol: picks its verify length (`tier_steps`)

  def __init__(self, target_graphdef, drafter, *, sampling: SamplingSpec = SamplingSpec(),
               stop_ids: Tuple[int, ...] = (), config: ControllerConfig = ControllerConfig(),
               cost_table: Optional[CostTable] = None, trace: bool = False,
               placement=None, tree: Optional[TreeConfig] = None,
               profiled: Optional[dict] = None):
    if tree is not None and trace:
      raise ValueError('verify_length=auto_tree records no trace (--trace_json: use tree or '
                       'auto)')
    if tree is not None and placement is not None:
      raise ValueError('verify_length=auto_tree runs on one device (no --config.mesh)')
    self.config = config
    self.placement = placement
    self.drafter = drafter
    self.tree = tree
    self.costs = cost_table or CostTable()
    # Tables by `costs.fingerprint`; `runner.decode` shares `costs.PROFILED` across its
    # controllers (one per call), so that calls in one shape bucket profile once.
    self._profiled = {} if profiled is None else profiled
    tiers = {}
    for g in config.tiers:
      d = drafter if tree and g else tier_drafter(drafter, g)
      if d is not None:
        tiers[g] = d
    if len(tiers) < 2 or 0 not in tiers:
      raise ValueError(f'controller: drafter {type(drafter).__name__} supports too few of '
                       f'the tiers {config.tiers} (need 0 and one positive tier)')
    # The most drafts a step can accept (a tree tier: its depth, at most num_draft).
    self.max_gamma = drafter.num_draft if tree else max(tiers)
    self.depths = {g: min(g, self.max_gamma) for g in tiers} if tree else {}
    def make(d):
      engine = SpeculativeEngine(target_graphdef, drafter=d, sampling=sampling,
                                 stop_ids=stop_ids, trace=trace)
      return ShardedEngine(engine, placement) if placement else engine

    self._make = make
    # The largest chain: prefill, shadow proposals (a tree tier drafts on its drafter).
    self._chain = make(drafter) if tree else None
    self._checked = tree is not None   # every tree tier keeps the full drafter's state
    engines = {g: self._make(d) for g, d in tiers.items()}
    if tree:
      proposer = drafter.tree_proposer(tree.top_k)
      engines.update({g: TreeEngine(self._chain, proposer, g + 1, max_depth=self.depths[g])
                      for g in tiers if g})
    self._set_engines(engines)
    self.last_trace = []
    self.row0_tiers = []    # the tier of each of row 0's verify steps (last `generate`)
    self._probe_every = {}  # batch size -> tier-0 probe interval, kept across generations
    self._carried = {}      # batch size -> pooled (α_G, π) at the end of the last one

  def _set_engines(self, engines):
    """Engines per tier (each runs its chunks through `engine.run`)."""
    self.engines = engines
    # No tier can pay at this batch size: plain AR steps, no taps and no drafter update
    # (nothing will be proposed for the rest of the generation).
    self._plain_ar = self._make(NoDrafter())

  def _shadow(self, target_params, drafter_params, state):
    """`shadow_proposal` of the largest tier, jitted per engine and shape (not per
    controller: `runner.decode` builds one per call)."""
    chain = self._largest_chain
    fn = _shadow_programs(chain, state.tokens_BL.shape)['shadow']
    return self._on_mesh(fn)(target_params, drafter_params, state)

  def _on_mesh(self, fn):
    """`fn` called under the placement's mesh (kernels see it while tracing)."""
    if self.placement is None:
      return fn

    def on_mesh(*args):
      with self.placement.context():
        return fn(*args)
    return on_mesh

  def _put(self, x):
    """A host array on device (replicated over the mesh, if any)."""
    if self.placement is None:
      return jax.device_put(x)
    return jax.device_put(x, self.placement.shardings(jax.sharding.PartitionSpec()))

  @property
  def _largest_chain(self):
    """The chain engine of the most drafts (a tree controller's own chain)."""
    return self.engines[self.max_gamma] if self._chain is None else self._chain

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
    return self._largest_chain.buffer_len(prompt_len, max_new_tokens)

  # --------------------------------------------------------------------- set-up

  def prefill(self, target_params, drafter_params, prompt_BP, prompt_len_B, **kw):
    """The largest tier's prefill, with stats wide enough for every tier."""
    state = self._largest_chain.prefill(target_params, drafter_params, prompt_BP,
                                        prompt_len_B, **kw)
    if not self._checked:
      self._share_state(target_params, drafter_params, prompt_BP.shape, state)
    return state

  def _share_state(self, target_params, drafter_params, prompt_shape, state):
    """Tiers whose rebuilt drafter keeps a different state truncate the largest one."""
    ref = self.engines[self.max_gamma].drafter
    engines = dict(self.engines)
    for g, engine in self.engines.items():
      if g not in (0, self.max_gamma) and not same_drafter_state(
          engine, target_params, drafter_params, prompt_shape, state):
        engines[g] = self._make(TruncatedDrafter(ref, g))
    engines[0] = self._make(TruncatedDrafter(ref, 0))
    self._set_engines(engines)
    self._checked = True

  def profile(self, target_params, drafter_params, state) -> CostTable:
    """Times every tier's step on copies of `state` (compiling first), and the largest
    tier's proposal alone; fills the table. Positive tiers verify their full width even
    where the drafter proposes nothing (`force_wide`): the table holds what a drafting step
    costs, and `step_cost` what a step costs given how often rows propose. The meta holds
    the buffer length and the fewest steps a timed run ran (rows finish)."""
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
    best, fewest = {}, steps
    for r in range(self.config.profile_repeats + 1):   # round 0 compiles; rounds
      for g in self.tiers:                             # interleave tiers against drift
        copy = jax.tree.map(lambda x: x.copy(), state)
        t0 = time.perf_counter()
        out = self.engines[g].run(target_params, drafter_params, copy, steps,
                                  force_wide=g > 0)
        done = int(distributed.host_values(out.step - state.step))
        if r:
          seconds = (time.perf_counter() - t0) / max(done, 1)
          best[g] = min(best.get(g, float('inf')), seconds)
          fewest = min(fewest, done)
    self.costs.costs.update({(b, g): c for g, c in best.items()})
    self.costs.meta.update(buffer_len=int(state.tokens_BL.shape[1]), fewest_steps=fewest)
    return self.costs

  def _profile_or_load(self, target_params, drafter_params, state) -> None:
    """The table of this model, drafter and state shape on this device: one profiled
    before (`profiled`), else the one cached beside the XLA cache (`costs.cached_path`),
    else `profile`, then kept in both unless some tier's timed run ran no step (every row
    done: an immediate stop token), whose table serves this generation only."""
    setup = (self.drafter, self.tiers, self.tree, self.sampling, self.config.profile_steps,
             self.config.profile_repeats,
             self.placement and dict(self.placement.mesh.shape))
    arrays = (target_params, drafter_params, state)
    key = costs_lib.fingerprint(setup, arrays)
    path = None if distributed.active() else costs_lib.cached_path(setup, arrays)
    b = state.tokens_BL.shape[0]
    if key in self._profiled:
      self.costs.update(self._profiled[key])
    elif path and os.path.exists(path):
      try:
        self.costs.update(CostTable.load(path))
      except ValueError:   # a damaged cache entry: profiled again below, and rewritten
        pass
    if self.costs.has(b, self.tiers):
      self._profiled.setdefault(key, self.costs.of_batch(b))
      return
    self.profile(target_params, drafter_params, state)
    if distributed.active():   # every process decides from process 0's timings
      shared = distributed.broadcast_json(
          [[[b, g, c] for (b, g), c in self.costs.costs.items()], self.costs.propose[b],
           self.costs.meta['fewest_steps']])
      self.costs.costs.update({(b, g): c for b, g, c in shared[0]})
      self.costs.propose[b] = shared[1]
      self.costs.meta['fewest_steps'] = shared[2]
    if self.costs.meta['fewest_steps'] == 0:
      return
    self._profiled[key] = self.costs.of_batch(b)
    if path:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      self._profiled[key].save(path)

  # --------------------------------------------------------------------- decoding

  def generate(self, target_params, drafter_params, state, between_chunks=None):
    """Runs chunks of steps until every row is done, each as `policy.decide` says: the
    tier, the chunk's length, and whether a shadow proposal of the largest tier is judged
    against what the chunk commits (before it, or in retrospect after it).
    between_chunks: `state -> (state, rows changed)` after every chunk (continuous
    batching refills finished rows there, `batching.serve`)."""
    b = state.tokens_BL.shape[0]
    if not self.costs.has(b, self.tiers):
      self._profile_or_load(target_params, drafter_params, state)
    # Load-aware verify lengths (DSpark): λ(B) of the table; a no-op for other drafters.
    state = state.replace(drafter_state=self.drafter.set_verify_cost(
        state.drafter_state, self.costs.verify_cost(b, self.tiers)))
    exact = self.engines[0].sampling.greedy or not self.drafter.samples_proposals
    carried = self._carried.get(b)
    estimate = AcceptanceEstimate(b, self.max_gamma, self.config, carried)
    hist, reached, done, num, prompt_len, max_new, steps_B = distributed.host_values((
        state.stats.accept_hist_BG1, state.stats.reached_BG, state.done_B,
        state.num_tokens_B, state.prompt_len_B, state.max_new_tokens, state.stats.steps_B))
    remaining = lambda: max_new - (num - prompt_len)
    policy = PolicyState.start(
        self.config, self.costs, b, self.tiers, exact=exact,
        retrospective=self.drafter.proposes_from_tokens, carried=carried is not None,
        live_B=~done, remaining_B=remaining(), probe_every=self._probe_every.get(b),
        depths=self.depths)
    proposing = reached[:, 0]   # steps that verified a draft at position 1
    row0_steps = steps_B[0]
    self.row0_tiers, trace = [], []
    if policy.retrospective and policy.cheap:   # first, judged on the prompt's own text
      estimate.observe_shadow(*self._judge_in_retrospect(state, np.zeros_like(num), num))
    while not done.all():
      decision = self.decide(estimate, policy)
      g = decision.tier
      t0 = time.perf_counter()
      num_before = num
      shadow_now = decision.shadow and not policy.retrospective
      matched = None
      if shadow_now:
        proposed, synced = self._shadow(target_params, drafter_params, state)
        state = state.replace(drafter_state=synced)
        if self.placement is not None:   # as the tiers' programs expect it
          state = self.placement.put_state(state)
      engine = self._plain_ar if decision.plain_ar else self.engines[g]
      state = engine.run(target_params, drafter_params, state, decision.chunk)
      if shadow_now:
        matched = self._on_mesh(shadow_match)(state.tokens_BL, state.num_tokens_B, *proposed)
      new_hist, reached, done, num, matched, steps_B = distributed.host_values((
          state.stats.accept_hist_BG1, state.stats.reached_BG, state.done_B,
          state.num_tokens_B, matched, state.stats.steps_B))
      if decision.shadow and policy.retrospective and not done.all():
        matched = self._judge_in_retrospect(state, num_before, num)
      steps = int(new_hist.sum() - hist.sum())
      self.row0_tiers += [g] * int(steps_B[0] - row0_steps)
      row0_steps = steps_B[0]
      trace.append((g, steps, time.perf_counter() - t0))
      estimate.observe(new_hist - hist, reached[:, 0] - proposing, policy.depth(g))
      samples = 0
      if matched is not None:
        estimate.observe_shadow(*matched)
        samples = int(np.max(np.sum(matched[1] > 0, axis=1), initial=0))
      policy = decision.state.observed(decision, float(np.sum(num - num_before)), steps,
                                       ~done, remaining(), samples)
      hist, proposing = new_hist, reached[:, 0]
      if between_chunks is not None:
        state, changed = between_chunks(state)
        if changed:   # new rows: their counts start afresh
          hist, reached, done, num, prompt_len, max_new, steps_B = distributed.host_values((
              state.stats.accept_hist_BG1, state.stats.reached_BG, state.done_B,
              state.num_tokens_B, state.prompt_len_B, state.max_new_tokens,
              state.stats.steps_B))
          proposing, row0_steps = reached[:, 0], steps_B[0]
          policy = dataclasses.replace(policy, live_B=~done, remaining_B=remaining())
    self.last_trace = trace
    self._probe_every[b] = policy.probe_every
    self._carried[b] = estimate.pooled()
    return state

  def decide(self, estimate: AcceptanceEstimate, policy: PolicyState) -> Decision:
    """The next chunk's `Decision`: `policy.decide` on this controller's cost table."""
    return decide(estimate, self.costs, policy)

  def _judge_in_retrospect(self, state, since_B: np.ndarray, num_B: np.ndarray):
    """Host copies of `retrospective_match` over the lengths since `since_B`, at most the
    last `max_steps_per_decision` before `num_B` (host copies of the state's counts)."""
    width = self.config.max_steps_per_decision
    judge = self._on_mesh(functools.partial(retrospective_match, self.drafter, width))
    return distributed.host_values(judge(
        state.tokens_BL, self._put(np.maximum(since_B, num_B - width)), state.num_tokens_B))

  def tier_steps(self) -> dict:
    """{tier: verify steps summed over rows} of the last `generate`."""
    out = {}
    for g, n, _ in self.last_trace:
      out[g] = out.get(g, 0) + n
    return out

  def tier_usage(self) -> dict:
    """{tier: fraction of row-steps} of the last `generate`."""
    steps = self.tier_steps()
    return {g: n / (sum(steps.values()) or 1) for g, n in steps.items()}


@ProgramCache
def _shadow_programs(chain) -> dict:
  """The jitted `shadow_proposal` of a chain engine; one set per shape of its states."""
  return {'shadow': jax.jit(functools.partial(shadow_proposal, chain))}
