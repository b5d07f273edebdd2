"""The speculative decoding engine: prefill, then draft → verify → accept → commit steps.

One jitted step serves every drafter (see `drafter.py`); plain AR decoding is the same
loop with `NoDrafter` (γ = 0), so speedups compare like with like.

Schedule (as z-lab's `dflash_generate` and the serving engines): the prefill runs the
target over the whole prompt and commits the first token from its last logits (TTFT).
Every step then verifies [anchor, d_1..d_γ] in one target forward, where the anchor is the
last committed token (not yet in the target cache) and the drafts are what the drafter
proposed from the committed context. Near the end of the budget a row verifies at most
`remaining` drafts (z-lab's shrinking verify size: all may be accepted; the bonus token
past the budget is dropped), so nothing past `max_new_tokens` counts. A step where no row
has a draft (an n-gram miss, an empty host proposal) runs the target over the anchor alone,
so it costs an AR step.

One step driver: `run_fn` runs steps inside one `lax.while_loop` until every row is done,
`max_steps` steps ran, or (`until_row_done`) some live row finished. `generate`, the
verify-length controller's chunks and continuous batching all call `run`; the host loop
calls `step` with a host-made proposal. Compiled programs are cached per engine and token
buffer shape as closures (the engine's hash is computed once), so a call costs no
static-argument hashing, in an LRU (`compiled_programs.ProgramCache`) that bounds what a
long-lived process holds.

An engine with a `placement` (a device mesh) compiles the same programs with in/out
shardings (`jit_program`, the one jit site of both engines): params keep the sharding they
were placed with, the decode state is sharded by its declared logical axes (batch over the
`batch` mesh axes, KV heads over `tensor`), and calls run under the mesh, so Pallas kernels
wrap themselves in `jax.shard_map`. Across processes (`dspec.distributed`) the leaves the
host reads between calls are replicated, so every process takes the same decisions, and
prompts enter as global arrays.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from dspec import distributed, sharding
from dspec.compiled_programs import ProgramCache
from dspec.decoding import drafter as drafter_lib
from dspec.sampling import SamplingSpec, processed_probs, sample_from_probs
from dspec.decoding.state import (DecodeState, DecodeStats, DecodeTrace, DraftContext,
                                  Proposal, StepMasks)
from dspec.decoding.verification import greedy_verify, rejection_verify_logits

NO_STEP_LIMIT = 2**31 - 1


@functools.lru_cache(maxsize=256)
def device_scalar(value, dtype=np.int32, placement=None) -> jax.Array:
  """`value` as a device scalar of `dtype` (replicated over `placement`'s mesh), transferred
  once: chunk limits repeat, and each transfer costs host time at every chunk boundary."""
  value = np.dtype(dtype).type(value)
  return jax.device_put(value, placement and placement.shardings(P()))


@typing.runtime_checkable
class Engine(typing.Protocol):
  """What the runner, the benchmarks and `batching.serve` call: the chain engine
  (`SpeculativeEngine`), `tree_engine.TreeEngine`, `host_loop.HostEngine` (each on one
  device or a mesh `placement`), and the controller driving them
  (`controller.VerifyLengthController`, `adaptive`)."""

  adaptive: bool
  row0_tiers: Any   # the tier of each of row 0's steps (controller), else None

  @property
  def num_draft(self) -> int: ...

  @property
  def sampling(self) -> SamplingSpec: ...

  @property
  def drafter(self) -> Any: ...

  def buffer_len(self, prompt_len: int, max_new_tokens: int) -> int: ...

  def prefill(self, target_params, drafter_params, prompt_BP, prompt_len_B,
              **kw) -> DecodeState: ...

  def generate(self, target_params, drafter_params, state) -> DecodeState: ...

  def tier_steps(self) -> dict: ...


@dataclasses.dataclass(frozen=True)
class SpeculativeEngine:
  """Static description of a decoding program (hashable; keys the compiled programs).

  target_graphdef: `nnx.split(target)[0]`; params are passed to every call separately.
  trace: record row 0's proposals per step (`DecodeState.trace`). placement: the mesh its
  programs run on (None: one device); params must be placed on it (`Placement.put_params`).
  """

  target_graphdef: Any
  drafter: Any = drafter_lib.NoDrafter()
  sampling: SamplingSpec = SamplingSpec()
  stop_ids: Tuple[int, ...] = ()
  trace: bool = False
  placement: Optional[sharding.Placement] = None
  # The engine protocol's controller face (`VerifyLengthController` overrides both): a
  # fixed engine verifies every proposal whole and reports no tiers.
  adaptive = False
  row0_tiers = None

  def tier_steps(self) -> dict:
    return {}

  def __hash__(self):
    cached = self.__dict__.get('_hash')
    if cached is None:
      cached = hash((self.target_graphdef, self.drafter, self.sampling, self.stop_ids,
                     self.trace, self.placement))
      object.__setattr__(self, '_hash', cached)
    return cached

  @property
  def num_draft(self) -> int:
    return self.drafter.num_draft

  def with_drafter(self, drafter) -> 'SpeculativeEngine':
    return dataclasses.replace(self, drafter=drafter)

  def buffer_len(self, prompt_len: int, max_new_tokens: int) -> int:
    """Cache/token-buffer length of a generation: every committed token. A verify near
    the budget reaches past it, but drafts are clipped to the remaining budget, so the
    positions past it are never read for a commit, and their writes are dropped (the
    buffer does not grow with γ: attention over it is most of a large batch's step)."""
    return prompt_len + max_new_tokens

  # ----------------------------------------------------------------- pure functions

  def context(self, state: DecodeState) -> DraftContext:
    return DraftContext(state.tokens_BL, state.num_tokens_B, self.sampling,
                        state.temperature, state.top_p,
                        state.max_new_tokens - state.generated_B())

  def _pick(self, logits_BV, key, temperature, top_p):
    """The token the target alone would emit from these logits."""
    if self.sampling.greedy:
      return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    return sample_from_probs(key, processed_probs(logits_BV, self.sampling, temperature,
                                                  top_p))

  def prefill_fn(self, target_params, drafter_params, prompt_BP, prompt_len_B,
                 temperature, top_p, max_new_tokens, seed, allowed_BW=None, *,
                 buffer_len: int) -> DecodeState:
    """Runs the target over every prompt token and commits the first generated token
    (from the tokens `allowed_BW` allows, a packed bitmask; None: any)."""
    target = nnx.merge(self.target_graphdef, target_params)
    b, p = prompt_BP.shape
    rows = jnp.arange(b)
    prompt_len_B = prompt_len_B.astype(jnp.int32)
    tokens_BL = jnp.zeros((b, buffer_len), jnp.int32).at[:, :p].set(prompt_BP)
    out = target(prompt_BP, cache=target.init_cache(b, buffer_len), taps=self.drafter.taps)
    key = jax.random.key(seed)
    temperature = jnp.asarray(temperature, jnp.float32)
    top_p = jnp.asarray(top_p, jnp.float32)
    last_BV = out.logits_BTV[rows, prompt_len_B - 1]
    if allowed_BW is not None:
      last_BV = mask_logits(last_BV, allowed_BW)
    first_B = self._pick(last_BV,
                         jax.random.fold_in(key, NO_STEP_LIMIT), temperature, top_p)
    tokens_BL = tokens_BL.at[rows, prompt_len_B].set(first_B)
    max_new_tokens = jnp.asarray(max_new_tokens, jnp.int32)
    stopped_B = jnp.zeros((b,), bool)
    for sid in self.stop_ids:
      stopped_B |= first_B == sid
    state = DecodeState(
        tokens_BL=tokens_BL, num_tokens_B=prompt_len_B + 1, prompt_len_B=prompt_len_B,
        done_B=stopped_B | (max_new_tokens <= 1), cache=out.cache.with_lengths(prompt_len_B),
        drafter_state=(), key=key, step=jnp.zeros((), jnp.int32), temperature=temperature,
        top_p=top_p, max_new_tokens=max_new_tokens,
        stats=DecodeStats.zeros(b, self.num_draft, buffer_len),
        trace=DecodeTrace.zeros(buffer_len, self.num_draft) if self.trace else None)
    dstate = self.drafter.init(drafter_params, target, self.context(state), out)
    return state.replace(drafter_state=dstate)

  def _verify(self, target, key, state: DecodeState, verify_BG1, proposal: Proposal,
              num_proposed_B, force_wide=False, allowed_BG1W=None):
    """(target output with logits dropped, num accepted [B], emitted tokens [B, γ+1]) of
    the target forward over [anchor, drafts], each position's logits restricted to what
    `allowed_BG1W` (packed bitmasks) allows. When no live row has a draft (and not
    `force_wide`), the forward runs over the anchor alone (an AR step's cost) and hidden,
    taps and emitted tokens are zero-padded to γ+1 slots: nothing past the anchor is
    accepted, so none is committed."""

    def run(cache, tokens_BT, drafts_BG, num_B, q_BGV):
      out = target(tokens_BT, cache=cache, taps=self.drafter.taps)
      logits_BTV = out.logits_BTV
      if allowed_BG1W is not None:
        logits_BTV = mask_logits(logits_BTV, allowed_BG1W[:, :tokens_BT.shape[1]])
      if self.sampling.greedy:
        n_B, emitted_BT = greedy_verify(drafts_BG, num_B, logits_BTV)
      else:
        n_B, emitted_BT = rejection_verify_logits(
            key, drafts_BG, num_B, q_BGV, logits_BTV,
            lambda x: processed_probs(x, self.sampling, state.temperature, state.top_p))
      return out._replace(logits_BTV=None), n_B, emitted_BT

    wide = lambda cache: run(cache, verify_BG1, proposal.tokens_BG, num_proposed_B,
                             proposal.q_BGV)
    width = verify_BG1.shape[1]
    if width == 1:
      return wide(state.cache)

    def anchor_only(cache):
      q_BGV = None if proposal.q_BGV is None else proposal.q_BGV[:, :0]
      out, n_B, emitted_B1 = run(cache, verify_BG1[:, :1], proposal.tokens_BG[:, :0],
                                 jnp.zeros_like(num_proposed_B), q_BGV)
      pad = lambda x: jnp.pad(x, [(0, 0), (0, width - 1)] + [(0, 0)] * (x.ndim - 2))
      return (out._replace(hidden_BTD=pad(out.hidden_BTD), taps_BTND=pad(out.taps_BTND)),
              n_B, pad(emitted_B1))

    # Exactly one of the two forwards runs, each in a loop of 0 or 1 trips carrying the
    # cache and the result (`_once_if`).
    blank = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                         jax.eval_shape(wide, state.cache))
    result = (blank[0]._replace(cache=state.cache),) + blank[1:]
    any_proposed = jnp.any((num_proposed_B > 0) & ~state.done_B) | force_wide
    result = _once_if(any_proposed, lambda r: wide(r[0].cache), result)
    return _once_if(~any_proposed, lambda r: anchor_only(r[0].cache), result)

  def _step_keys(self, state: DecodeState):
    """(draft key, verify key) of the state's step."""
    return jax.random.split(jax.random.fold_in(state.key, state.step))

  def propose_fn(self, target_params, drafter_params, state: DecodeState):
    """The first half of `step_fn`: (state with the drafter synced, its proposal), for a
    host that edits the proposal before `step_fn(..., synced=True)` verifies it."""
    target = nnx.merge(self.target_graphdef, target_params)
    ctx = self.context(state)
    dstate = self.drafter.sync(drafter_params, state.drafter_state, target, ctx)
    proposal = self.drafter.propose(drafter_params, dstate, target, ctx,
                                    self._step_keys(state)[0])
    return state.replace(drafter_state=dstate), proposal

  def shadow_fn(self, target_params, drafter_params, state: DecodeState):
    """What a step would propose now, unverified (the controller's shadow evidence): (the
    drafter state synced for it, the proposal)."""
    synced, proposal = self.propose_fn(target_params, drafter_params, state)
    return synced.drafter_state, proposal

  def step_fn(self, target_params, drafter_params, state: DecodeState,
              proposal: Optional[Proposal] = None, force_wide=False,
              masks: Optional[StepMasks] = None, *, synced: bool = False) -> DecodeState:
    """One draft → verify → accept → commit step for every live row; `force_wide` (a
    bool, traced or not) verifies the full width even when no row has a draft (what the
    controller's cost profile times: the cost of a step that drafts). Structured output
    passes `masks` (`StepMasks`: the verify positions' allowed tokens and the drafts'
    laws under forced tokens); `synced`: the drafter state is `propose_fn`'s already."""
    target = nnx.merge(self.target_graphdef, target_params)
    b = state.tokens_BL.shape[0]
    rows = jnp.arange(b)
    key_draft, key_verify = self._step_keys(state)
    ctx = self.context(state)
    dstate = state.drafter_state if synced else self.drafter.sync(
        drafter_params, state.drafter_state, target, ctx)
    if proposal is None:
      proposal = self.drafter.propose(drafter_params, dstate, target, ctx, key_draft)
    if masks is not None and proposal.q_BGV is not None:
      proposal = proposal._replace(q_BGV=_constrained_q(proposal, masks))
    g = proposal.tokens_BG.shape[1]
    remaining_B = state.max_new_tokens - state.generated_B()
    # A draft id outside the vocabulary ends the proposal there (and is never embedded:
    # an out-of-range embedding lookup is NaN, which would poison the KV cache).
    in_vocab_BG = (proposal.tokens_BG >= 0) & (proposal.tokens_BG < target.cfg.vocab_size)
    proposal = proposal._replace(tokens_BG=jnp.where(in_vocab_BG, proposal.tokens_BG, 0))
    num_proposed_B = jnp.minimum(proposal.num_proposed_B, remaining_B)
    num_proposed_B = jnp.clip(num_proposed_B, 0, _first_false(in_vocab_BG))

    # Verify [anchor, d1..dγ] at positions start..start+γ in one target forward.
    anchor_B = state.tokens_BL[rows, state.num_tokens_B - 1]
    start_B = state.cache.lengths_B
    verify_BG1 = jnp.concatenate([anchor_B[:, None], proposal.tokens_BG], axis=1)
    out, n_B, emitted_BG1 = self._verify(target, key_verify, state, verify_BG1, proposal,
                                         num_proposed_B, force_wide,
                                         None if masks is None else masks.allowed_BG1W)

    # Commit: cut at the first stop token and at the budget; done rows write nothing.
    live_B = ~state.done_B
    j = jnp.arange(g + 1)[None, :]
    is_stop = jnp.zeros_like(emitted_BG1, bool)
    for sid in self.stop_ids:
      is_stop |= emitted_BG1 == sid
    is_stop &= j <= n_B[:, None]
    first_stop_B = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1), g + 1)
    count_B = jnp.minimum(jnp.minimum(n_B + 1, first_stop_B + 1), remaining_B)
    count_B = jnp.where(live_B, count_B, 0)
    pos_BG1 = state.num_tokens_B[:, None] + j
    pos_BG1 = jnp.where(j < count_B[:, None], pos_BG1, state.tokens_BL.shape[1])
    tokens_BL = state.tokens_BL.at[rows[:, None], pos_BG1].set(emitted_BG1, mode='drop')
    num_tokens_B = state.num_tokens_B + count_B
    stopped_B = first_stop_B < count_B
    done_B = state.done_B | stopped_B | (num_tokens_B - state.prompt_len_B
                                         >= state.max_new_tokens)
    cache = out.cache.with_lengths(jnp.where(live_B, start_B + n_B + 1, start_B))
    accepted_B = jnp.minimum(n_B, count_B)  # a stop token cuts accepted drafts too

    live = live_B.astype(jnp.int32)
    s = state.stats
    stats = s.replace(
        steps_B=s.steps_B + live, committed_B=s.committed_B + count_B,
        row0_committed_S=s.row0_committed_S.at[s.steps_B[0]].set(count_B[0], mode='drop'))
    if g:
      k_BG = jnp.arange(1, s.reached_BG.shape[1] + 1)[None, :]
      reached_BG = live_B[:, None] & (k_BG <= num_proposed_B[:, None]) & (
          k_BG <= n_B[:, None] + 1)
      passed_BG = reached_BG & (k_BG <= n_B[:, None])
      stats = stats.replace(
          accept_hist_BG1=s.accept_hist_BG1 + live[:, None] * (
              jnp.arange(s.accept_hist_BG1.shape[1])[None, :] == accepted_B[:, None]),
          proposed_B=s.proposed_B + live * num_proposed_B,
          accepted_B=s.accepted_B + live * accepted_B,
          reached_BG=s.reached_BG + reached_BG, passed_BG=s.passed_BG + passed_BG)
    else:
      # An AR step (no draft position) counts as a step accepting 0 drafts, and its
      # program does no per-draft counting (~1-2% of a step on a γ-wide state here).
      stats = stats.replace(accept_hist_BG1=s.accept_hist_BG1.at[:, 0].add(live))
    trace = state.trace
    if isinstance(trace, DecodeTrace):   # a tree trace (auto_tree's tier 0) stays as it is
      at = jnp.where(live_B[0], s.steps_B[0], trace.num_proposed_S.shape[0])
      width = trace.drafts_SG.shape[1]
      drafts_G = jnp.zeros((width,), jnp.int32).at[:g].set(proposal.tokens_BG[0, :width])
      trace = DecodeTrace(trace.drafts_SG.at[at].set(drafts_G, mode='drop'),
                          trace.num_proposed_S.at[at].set(num_proposed_B[0], mode='drop'),
                          trace.num_accepted_S.at[at].set(accepted_B[0], mode='drop'))
    new_state = state.replace(tokens_BL=tokens_BL, num_tokens_B=num_tokens_B,
                              done_B=done_B, cache=cache, step=state.step + 1, stats=stats,
                              trace=trace)
    dstate = self.drafter.update(drafter_params, dstate, target, self.context(new_state), out,
                                 start_B, n_B)
    return new_state.replace(drafter_state=dstate)

  def run_fn(self, target_params, drafter_params, state: DecodeState, max_steps,
             force_wide=False, *, until_row_done: bool = False) -> DecodeState:
    """Steps until every row is done or `max_steps` steps ran; with `until_row_done` also
    until some row that was live at the start has finished. `force_wide`: see `step_fn`."""
    return run_steps(lambda st: self.step_fn(target_params, drafter_params, st,
                                             force_wide=force_wide),
                     state, max_steps, until_row_done)

  # ---------------------------------------------------------------- jitted entry points

  def prefill(self, target_params, drafter_params, prompt_BP, prompt_len_B, *,
              temperature=0.0, top_p=1.0, max_new_tokens, seed=0,
              buffer_len: Optional[int] = None, allowed_BW=None) -> DecodeState:
    """`prefill_fn` jitted. buffer_len: at least the prompt width and every row's prompt +
    max_new_tokens (`runner.decode` passes a shape bucket); None: `self.buffer_len`.
    allowed_BW: see `prefill_fn`. On a mesh the batch size must divide by its batch axes."""
    b, p = prompt_BP.shape
    buffer_len = buffer_len or self.buffer_len(p, max_new_tokens)
    inputs = (np.asarray(prompt_BP, np.int32), np.asarray(prompt_len_B, np.int32),
              np.float32(temperature), np.float32(top_p), np.int32(max_new_tokens),
              np.int32(seed))
    if self.placement is None:
      inputs = jax.device_put(inputs)
    else:   # the program places them; across processes the prompts enter as global arrays
      multiple = self.placement.batch_size_multiple
      if b % multiple:
        raise ValueError(f'batch size {b} is not divisible by the mesh batch axes '
                         f'(size {multiple}); use a multiple of {multiple}')
      if distributed.active():
        inputs = self.placement.put_batch(inputs[:2]) + inputs[2:]
    return _programs(self, (b, buffer_len))['prefill'](
        target_params, drafter_params, *inputs, allowed_BW, buffer_len=buffer_len)

  def run(self, target_params, drafter_params, state, max_steps: Optional[int] = None, *,
          until_row_done: bool = False, force_wide: bool = False) -> DecodeState:
    """`run_fn` jitted (the state is donated); `max_steps` None: no step limit.
    `force_wide` (`step_fn`) is a traced argument: timing the drafting step costs no
    extra compile."""
    limit = device_scalar(NO_STEP_LIMIT if max_steps is None else int(max_steps),
                          placement=self.placement)
    force_wide = device_scalar(bool(force_wide), np.bool_, self.placement)
    name = 'run_until_row_done' if until_row_done else 'run'
    programs = _programs(self, state.tokens_BL.shape)
    return programs[name](target_params, drafter_params, state, limit, force_wide)

  def generate(self, target_params, drafter_params, state) -> DecodeState:
    return self.run(target_params, drafter_params, state)

  def step(self, target_params, drafter_params, state, proposal=None) -> DecodeState:
    return _programs(self, state.tokens_BL.shape)['step'](target_params, drafter_params,
                                                          state, proposal)

  def warm_marks(self, tokens_shape) -> set:
    """A set that lives as long as the programs compiled for states of `tokens_shape`
    (an LRU may drop them): callers note there what they warmed up."""
    return _programs(self, tokens_shape).setdefault('warm', set())

  def propose(self, target_params, drafter_params, state):
    """`propose_fn` jitted (the state is donated)."""
    return _programs(self, state.tokens_BL.shape)['propose'](target_params, drafter_params,
                                                             state)

  def shadow(self, target_params, drafter_params, state):
    """`shadow_fn` jitted, the state kept (the controller's cost profile times it
    repeatedly on one state)."""
    return _programs(self, state.tokens_BL.shape)['shadow'](target_params, drafter_params,
                                                            state)

  def masked_step(self, target_params, drafter_params, state, proposal, masks: StepMasks,
                  *, synced: bool) -> DecodeState:
    """`step_fn` jitted with a constraint's `masks` (the state is donated); `synced`: the
    state comes from `propose`."""
    name = 'step_synced' if synced else 'step'
    return _programs(self, state.tokens_BL.shape)[name](
        target_params, drafter_params, state, proposal, False, masks)


def allowed_tokens(allowed_NW, vocab: int):
  """[..., vocab] bool of packed bitmasks [..., W] (bit v % 32 of word v // 32 set where
  token v is allowed, as grammar engines fill them)."""
  token_V = jnp.arange(vocab, dtype=jnp.int32)
  words_NV = jnp.take(allowed_NW, token_V // 32, axis=-1)
  return ((words_NV >> (token_V % 32)) & 1).astype(bool)


def mask_logits(logits_NV, allowed_NW):
  """Logits of the tokens `allowed_NW` does not allow set to -inf."""
  return jnp.where(allowed_tokens(allowed_NW, logits_NV.shape[-1]), logits_NV, -jnp.inf)


def _constrained_q(proposal: Proposal, masks: StepMasks):
  """The law each draft was drawn from under `masks` (see `StepMasks`): the drafter's q;
  at a position with a forced token, q's allowed part plus the rest of its mass on that
  token; past the drafter's own drafts, one-hot on the forced draft."""
  q_BGV = proposal.q_BGV
  g, vocab = q_BGV.shape[1], q_BGV.shape[2]
  q_in_BGV = jnp.where(allowed_tokens(masks.allowed_BG1W[:, :g], vocab), q_BGV, 0.0)
  moved_BG1 = jnp.maximum(1.0 - jnp.sum(q_in_BGV, axis=-1, keepdims=True), 0.0)
  forced_BG = masks.forced_BG
  mixed_BGV = q_in_BGV + moved_BG1 * jax.nn.one_hot(jnp.maximum(forced_BG, 0), vocab,
                                                    dtype=q_BGV.dtype)
  q_BGV = jnp.where((forced_BG >= 0)[..., None], mixed_BGV, q_BGV)
  own_BG = jnp.arange(g)[None, :] < masks.own_B[:, None]
  return jnp.where(own_BG[..., None], q_BGV,
                   jax.nn.one_hot(proposal.tokens_BG, vocab, dtype=q_BGV.dtype))


def run_steps(step, state: DecodeState, max_steps, until_row_done: bool) -> DecodeState:
  """`step` in a `lax.while_loop` until every row is done or `max_steps` steps ran (with
  `until_row_done`, also until a row live at the start has finished): every engine's
  step driver."""
  stop = state.step + jnp.minimum(max_steps, NO_STEP_LIMIT - state.step)   # saturating
  done_at_start_B = state.done_B

  def go_on(st):
    more = (st.step < stop) & ~jnp.all(st.done_B)
    if until_row_done:
      more &= ~jnp.any(st.done_B & ~done_at_start_B)
    return more

  return jax.lax.while_loop(go_on, step, state)


def _first_false(mask_BG):
  """Index of each row's first False in mask_BG [B, G] (G when all are True)."""
  g = mask_BG.shape[1]
  return jnp.min(jnp.where(mask_BG, g, jnp.arange(g)[None, :]), axis=1, initial=g)


def _once_if(pred, fn, carry):
  """`fn(carry)` if `pred` else `carry`, as a while loop of 0 or 1 trips: XLA updates a
  loop-carried buffer (the KV cache) in place, where a `lax.cond` branch copies it."""
  return jax.lax.while_loop(lambda c: c[0] < pred.astype(jnp.int32),
                            lambda c: (c[0] + 1, fn(c[1])), (jnp.int32(0), carry))[1]


def jit_program(engine, fn, **jit_kw):
  """`fn(target_params, drafter_params, *args)` jitted for `engine`: plainly, or on its
  placement's mesh (`_PlacedProgram`). Every engine program is built here."""
  if engine.placement is None:
    return jax.jit(fn, **jit_kw)
  jit_kw.pop('static_argnames', None)   # bound per call (in_shardings rule out kwargs)
  return _PlacedProgram(engine.placement, fn, jit_kw)


class _PlacedProgram:
  """`fn` jitted with a placement's in/out shardings, called under its mesh. The shardings
  follow from the arguments (`_shardings`), so one jit is built per argument structure, at
  its first call (a program set holds one state shape). Across processes a `DecodeState`
  argument is first moved to the program's shardings (a no-op for leaves already there,
  e.g. a state the controller re-placed with `put_state`)."""

  def __init__(self, placement: sharding.Placement, fn, jit_kw: dict):
    self.placement, self.fn, self.jit_kw, self.jits = placement, fn, jit_kw, {}

  def __call__(self, target_params, drafter_params, *args, **static):
    key = (jax.tree.structure(args), tuple(sorted(static.items())))
    with self.placement.context():
      if key not in self.jits:
        self.jits[key] = self._build(target_params, drafter_params, args, static)
      jitted, args_sh = self.jits[key]
      if distributed.active():
        args = tuple(jax.device_put(x, sh) if isinstance(x, DecodeState) else x
                     for x, sh in zip(args, args_sh))
      return jitted(target_params, drafter_params, *args)

  def _build(self, target_params, drafter_params, args, static):
    fn = functools.partial(self.fn, **static)
    out = jax.eval_shape(fn, target_params, drafter_params, *args)
    args_sh = _shardings(self.placement, args)
    params_sh = tuple(jax.tree.map(lambda x: x.sharding, p)
                      for p in (target_params, drafter_params))
    return jax.jit(fn, in_shardings=params_sh + args_sh,
                   out_shardings=_shardings(self.placement, out), **self.jit_kw), args_sh

  def clear_cache(self):   # `ProgramCache` eviction
    for jitted, _ in self.jits.values():
      jitted.clear_cache()
    self.jits.clear()


# What the host reads of a state between calls: replicated across processes.
_HOST_READ = ('tokens_BL', 'num_tokens_B', 'prompt_len_B', 'done_B', 'stats')


def _shardings(placement: sharding.Placement, tree):
  """The shardings of a program's arguments or result: a struct declaring `LOGICAL_AXES`
  by them (`Placement.state_specs`; across processes a `DecodeState`'s `_HOST_READ` leaves
  replicated), another array with its leading axis on the batch axes (prompts, masks,
  trees), a scalar replicated."""
  declared = lambda x: hasattr(type(x), 'LOGICAL_AXES')

  def one(x):
    if not declared(x):
      return placement.batch_specs(x) if hasattr(x, 'shape') else P()
    specs = placement.state_specs(x)
    if isinstance(x, DecodeState) and distributed.active():
      specs = specs.replace(**{name: jax.tree.map(lambda _: P(), getattr(specs, name),
                                                  is_leaf=lambda s: isinstance(s, P))
                               for name in _HOST_READ})
    return specs
  return placement.shardings(jax.tree.map(one, tree, is_leaf=declared))


@ProgramCache
def _programs(engine: SpeculativeEngine) -> dict:
  """The engine's jitted programs; one set per (batch, buffer) shape of its states."""
  jit = functools.partial(jit_program, engine)
  return {
      'prefill': jit(engine.prefill_fn, static_argnames=('buffer_len',)),
      'run': jit(engine.run_fn, donate_argnums=2),
      'run_until_row_done': jit(
          functools.partial(engine.run_fn, until_row_done=True), donate_argnums=2),
      'step': jit(engine.step_fn, donate_argnums=2),
      'propose': jit(engine.propose_fn, donate_argnums=2),
      'shadow': jit(engine.shadow_fn),
      'step_synced': jit(functools.partial(engine.step_fn, synced=True), donate_argnums=2),
  }
