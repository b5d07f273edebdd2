"""Load-aware verify length: the one host driver around `policy.decide`.

Speculation pays when a verify of γ + 1 tokens costs about one AR step (memory-bound, low
load) and costs once it is compute-bound (large batch, CPU). As SGLang's adaptive mode
(one compiled program per tier) and DSpark's load-aware scheduler (maximise τ × steps/s),
the controller keeps an `AcceptanceEstimate` and a step-cost table (`costs.py`, profiled
at start-up or cached) and before every chunk asks `policy.decide` for the tier (0 is
plain AR), the chunk's length and the evidence it gathers. Evidence sources: the
verified steps' acceptance counts, device shadow proposals (the largest tier's `engine.shadow`),
the retrospective judge (`estimate.retrospective_match`) and its host twin for drafters
proposing on the host (`host_loop.HostSession.judge`; their positive tiers are
`HostEngine`s, so their fallback is tier 0 of this policy). Every tier runs a verified
step: the output is exact at every tier switch.

With a `TreeConfig` ('auto_tree') the positive tiers are node budgets: tier g verifies a
tree of g drafted nodes (`TreeEngine`), of which a step accepts at most its depth.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Optional, Tuple

import jax
import numpy as np

from dspec import distributed
from dspec.decoding import costs as costs_lib
from dspec.decoding.costs import CostTable
from dspec.decoding.drafter import NoDrafter, TruncatedDrafter, host_drafter_factory
from dspec.decoding.engine import SpeculativeEngine
from dspec.decoding.estimate import AcceptanceEstimate, retrospective_match, shadow_match
from dspec.decoding.host_loop import HostEngine
from dspec.decoding.policy import ControllerConfig, Decision, PolicyState, decide
from dspec.decoding.tiers import same_drafter_state, tier_drafter
from dspec.decoding.tree_engine import TreeConfig, TreeEngine
from dspec.sampling import SamplingSpec


class VerifyLengthController:
  """The engine protocol (`prefill`, `generate`) choosing a tier per chunk; `last_trace`
  lists (tier, row-steps, seconds). `placement`: every tier runs on a mesh; `tree`:
  node-budget tiers; `profiled`: tables by `costs.fingerprint`, shared across
  controllers (`runner.decode` builds one per call)."""

  adaptive = True

  def __init__(self, target_graphdef, drafter, *, sampling: SamplingSpec = SamplingSpec(),
               stop_ids: Tuple[int, ...] = (), config: ControllerConfig = ControllerConfig(),
               cost_table: Optional[CostTable] = None, trace: bool = False,
               placement=None, tree: Optional[TreeConfig] = None,
               profiled: Optional[dict] = None):
    self.config, self.placement, self.drafter, self.tree = config, placement, drafter, tree
    self.trace = trace
    self.costs = cost_table or CostTable()
    self._profiled = {} if profiled is None else profiled
    tiers = {g: drafter if tree and g else tier_drafter(drafter, g) for g in config.tiers}
    tiers = {g: d for g, d in tiers.items() if d is not None}
    if len(tiers) < 2 or 0 not in tiers:
      raise ValueError(f'controller: drafter {type(drafter).__name__} supports too few of '
                       f'the tiers {config.tiers} (need 0 and one positive tier)')
    self.max_gamma = drafter.num_draft if tree else max(tiers)
    self.depths = {g: min(g, self.max_gamma) for g in tiers} if tree else {}

    def make(d, traced=trace):
      return SpeculativeEngine(target_graphdef, drafter=d, sampling=sampling,
                               stop_ids=stop_ids, trace=traced and not tree,
                               placement=placement)

    self._make = make
    largest = tiers[self.max_gamma] if not tree else drafter
    factory = host_drafter_factory(largest)
    self.host = HostEngine(make(largest), factory) if factory else None
    self._chain = make(drafter) if tree else self.host   # prefills (and drafts shadows)
    self._checked = tree is not None or self.host is not None   # tiers share one state
    engines = {g: self.host.with_width(g) if self.host and g else make(d)
               for g, d in tiers.items()}
    if tree:   # node-budget tiers over the chain engine (and so on its placement)
      chain, proposer = self._chain, drafter.tree_proposer(tree.top_k)
      engines.update({g: TreeEngine(chain, proposer, g + 1, self.depths[g], trace)
                      for g in tiers if g})
    self._set_engines(engines)
    self.last_trace, self.row0_tiers = [], []
    self._probe_every = {}  # batch size -> tier-0 probe interval, kept across generations
    self._carried = {}      # batch size -> pooled (α_G, π) at the end of the last one

  def _set_engines(self, engines):
    self.engines = engines
    # Nothing will be proposed before the batch ends: AR steps with no taps or updates.
    self._plain_ar = self._make(NoDrafter(), False)

  @property
  def _largest_chain(self):
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

  def _on_mesh(self, fn):
    """`fn` called under the placement's mesh (kernels see it while tracing)."""
    if self.placement is None:
      return fn

    def on_mesh(*args):
      with self.placement.context():
        return fn(*args)
    return on_mesh

  def _shadow(self, target_params, drafter_params, state):
    """What the largest tier would propose now ((tokens [B, G], count [B], start [B])),
    and the state with its drafter synced for it: the next steps record from there."""
    dstate, p = self._largest_chain.shadow(target_params, drafter_params, state)
    return (p.tokens_BG, p.num_proposed_B, state.num_tokens_B), state.replace(
        drafter_state=dstate)

  def prefill(self, target_params, drafter_params, prompt_BP, prompt_len_B, **kw):
    """The largest tier's prefill (with a trace: the largest tree's)."""
    first = self.engines[max(self.engines)] if self.tree and self.trace else self._largest_chain
    state = first.prefill(target_params, drafter_params, prompt_BP, prompt_len_B, **kw)
    for engine in self.engines.values():   # every host tier's verify widths, compiled now
      if isinstance(engine, HostEngine):
        engine.warm(target_params, drafter_params, state)
    if not self._checked:   # tiers whose drafter keeps another state truncate the largest
      ref, engines = self.engines[self.max_gamma].drafter, dict(self.engines)
      for g, engine in self.engines.items():
        if g not in (0, self.max_gamma) and not same_drafter_state(
            engine, target_params, drafter_params, prompt_BP.shape, state):
          engines[g] = self._make(TruncatedDrafter(ref, g))
      engines[0] = self._make(TruncatedDrafter(ref, 0))
      self._set_engines(engines)
      self._checked = True
    return state

  def profile(self, target_params, drafter_params, state) -> CostTable:
    """Times every tier's step and the largest tier's proposal (`costs.profile`)."""
    if self.host is not None:
      live_B = ~distributed.host_values(state.done_B)
      propose = lambda: self.host.session.drafter.propose(self.host.session.sequences, live_B)
    else:
      propose = lambda: self._shadow(target_params, drafter_params, state)
    return costs_lib.profile(self.engines, propose, self._plain_ar,
                             (target_params, drafter_params), state,
                             self.config.profile_steps, self.config.profile_repeats,
                             self.costs)

  def generate(self, target_params, drafter_params, state, between_chunks=None):
    """Runs chunks until every row is done, each as `decide` says, reading back once per
    chunk. between_chunks: `state -> (state, rows changed)` after every chunk (continuous
    batching refills finished rows there, `batching.serve`)."""
    b = state.tokens_BL.shape[0]
    params = (target_params, drafter_params)
    if not self.costs.has(b, self.tiers):
      setup = (self.drafter, self.tiers, self.tree, self.sampling, self.config.profile_steps,
               self.config.profile_repeats, self.placement and dict(self.placement.mesh.shape))
      costs_lib.profile_or_load(self.costs, setup, params + (state,), state, self._profiled,
                                self.tiers, lambda: self.profile(*params, state))
    state = state.replace(drafter_state=self.drafter.set_verify_cost(   # DSpark's λ(B)
        state.drafter_state, self.costs.verify_cost(b, self.tiers)))
    carried = self._carried.get(b)
    estimate = AcceptanceEstimate(b, self.max_gamma, self.config, carried)

    def read(st):   # (accepted-count histogram, proposing steps, done, num, row 0's steps,
      hist, reached, done, num, steps, lens, new = distributed.host_values((   # row ends)
          st.stats.accept_hist_BG1, st.stats.reached_BG, st.done_B, st.num_tokens_B,
          st.stats.steps_B, st.prompt_len_B, st.max_new_tokens))
      return hist, reached[:, 0], done, num, steps[0], lens + new

    hist, proposing, done, num, row0_steps, end_B = read(state)
    retrospective = self.drafter.proposes_from_tokens or self.host is not None
    policy = PolicyState.start(
        self.config, self.costs, b, self.tiers,
        exact=self.sampling.greedy or not self.drafter.samples_proposals,
        retrospective=retrospective, carried=carried is not None, live_B=~done,
        remaining_B=end_B - num, probe_every=self._probe_every.get(b), depths=self.depths,
        bursty=self.host is not None)
    self.row0_tiers, trace = [], []
    if policy.retrospective and policy.cheap:   # first, judged on the prompt's own text
      estimate.observe_shadow(*self._judge(state, np.zeros_like(num), num))
    while not done.all():
      decision = self.decide(estimate, policy)
      g, t0, num_before, matched = decision.tier, time.perf_counter(), num, None
      shadow_now = decision.shadow and not policy.retrospective
      if shadow_now:
        proposed, state = self._shadow(*params, state)
        if self.placement is not None:   # as the tiers' programs expect it
          state = self.placement.put_state(state)
      engine = self._plain_ar if decision.plain_ar else self.engines[g]
      state = engine.run(*params, state, decision.chunk)
      if shadow_now:
        matched = distributed.host_values(self._on_mesh(shadow_match)(
            state.tokens_BL, state.num_tokens_B, *proposed))
      new_hist, new_proposing, done, num, steps0, end_B = read(state)
      if decision.shadow and policy.retrospective and not done.all():
        matched = self._judge(state, num_before, num)
      steps = int(new_hist.sum() - hist.sum())
      self.row0_tiers += [g] * int(steps0 - row0_steps)
      trace.append((g, steps, time.perf_counter() - t0))
      estimate.observe(new_hist - hist, new_proposing - proposing, policy.depth(g))
      samples, accepted = 0, ()
      if matched is not None:
        estimate.observe_shadow(*matched)
        samples = int(np.max(np.sum(matched[1] > 0, axis=1), initial=0))
        accepted = matched[0][(matched[1] > 0) & matched[2]]
      policy = decision.state.observed(decision, float(np.sum(num - num_before)), steps,
                                       ~done, end_B - num, samples, accepted)
      hist, proposing, row0_steps = new_hist, new_proposing, steps0
      if between_chunks is not None:
        state, changed = between_chunks(state)
        if changed:   # new rows: their counts start afresh
          hist, proposing, done, num, row0_steps, end_B = read(state)
          policy = dataclasses.replace(policy, live_B=~done, remaining_B=end_B - num)
    if self.host is not None:
      self.host.finish(state)
    self.last_trace = trace
    self._probe_every[b] = policy.probe_every
    self._carried[b] = estimate.pooled()
    return state

  def decide(self, estimate: AcceptanceEstimate, policy: PolicyState) -> Decision:
    """The next chunk's `Decision`: `policy.decide` on this controller's cost table."""
    return decide(estimate, self.costs, policy)

  def _judge(self, state, since_B: np.ndarray, num_B: np.ndarray):
    """Shadow samples judged in retrospect over the lengths since `since_B`, at most the
    last `max_steps_per_decision` before `num_B` (host copies of the state's counts)."""
    width = self.config.max_steps_per_decision
    if self.host is not None:   # bursts: judged on the last chunk's worth of lengths
      self.host.session.sync(state)
      return self.host.session.judge(since_B, 4 * self.config.steps_per_decision)
    judge = self._on_mesh(functools.partial(retrospective_match, self.drafter, width))
    since = np.maximum(since_B, num_B - width)
    since = jax.device_put(since, self.placement and self.placement.shardings(
        jax.sharding.PartitionSpec()))
    return distributed.host_values(judge(state.tokens_BL, since, state.num_tokens_B))

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

