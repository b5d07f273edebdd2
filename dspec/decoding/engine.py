"""The speculative decoding engine: prefill, then draft → verify → accept → commit steps.

One jitted step serves every drafter (see `drafter.py`); plain AR decoding is the same
loop with `NoDrafter` (γ = 0), so speedups compare like with like. `generate` runs the step
inside `lax.while_loop` entirely on device; `step` runs it once (for host-side loops and
drafters that propose on the host, which pass their `Proposal` in).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspec.decoding import drafter as drafter_lib
from dspec.decoding.sampling import SamplingSpec, processed_probs
from dspec.decoding.state import DecodeState, DecodeStats, DraftContext, Proposal
from dspec.decoding.verification import greedy_verify, rejection_verify


@dataclasses.dataclass(frozen=True)
class SpeculativeEngine:
  """Static description of a decoding program (hashable; a jit cache key).

  target_graphdef: `nnx.split(target)[0]`; params are passed to every call separately.
  """

  target_graphdef: Any
  drafter: Any = drafter_lib.NoDrafter()
  sampling: SamplingSpec = SamplingSpec()
  stop_ids: Tuple[int, ...] = ()

  @property
  def num_draft(self) -> int:
    return self.drafter.num_draft

  def buffer_len(self, prompt_len: int, max_new_tokens: int) -> int:
    """Cache/token-buffer length a generation needs (verify writes γ past the anchor)."""
    return prompt_len + max_new_tokens + self.num_draft + 1

  # ----------------------------------------------------------------- pure functions

  def context(self, state: DecodeState) -> DraftContext:
    return DraftContext(state.tokens_BL, state.num_tokens_B, self.sampling,
                        state.temperature, state.top_p)

  def prefill_fn(self, target_params, drafter_params, prompt_BP, prompt_len_B,
                 temperature, top_p, max_new_tokens, seed, *, buffer_len: int) -> DecodeState:
    """Writes the target cache for every prompt token but the last (which is the anchor)."""
    target = nnx.merge(self.target_graphdef, target_params)
    b, p = prompt_BP.shape
    tokens_BL = jnp.zeros((b, buffer_len), jnp.int32).at[:, :p].set(prompt_BP)
    cache = target.init_cache(b, buffer_len)
    prefix_BT = prompt_BP[:, :max(p - 1, 1)]
    out = target(prefix_BT, cache=cache, taps=self.drafter.taps, compute_logits=False)
    cache = out.cache.with_lengths(prompt_len_B - 1)
    state = DecodeState(
        tokens_BL=tokens_BL, num_tokens_B=prompt_len_B.astype(jnp.int32),
        prompt_len_B=prompt_len_B.astype(jnp.int32), done_B=jnp.zeros((b,), bool),
        cache=cache, drafter_state=(), key=jax.random.key(seed),
        step=jnp.zeros((), jnp.int32), temperature=jnp.asarray(temperature, jnp.float32),
        top_p=jnp.asarray(top_p, jnp.float32),
        max_new_tokens=jnp.asarray(max_new_tokens, jnp.int32),
        stats=DecodeStats.zeros(b, self.num_draft))
    dstate = self.drafter.init(drafter_params, target, self.context(state), out)
    return state.replace(drafter_state=dstate)

  def step_fn(self, target_params, drafter_params, state: DecodeState,
              proposal: Optional[Proposal] = None) -> DecodeState:
    """One draft → verify → accept → commit step for every live row."""
    target = nnx.merge(self.target_graphdef, target_params)
    b = state.tokens_BL.shape[0]
    rows = jnp.arange(b)
    key = jax.random.fold_in(state.key, state.step)
    key_draft, key_verify = jax.random.split(key)
    ctx = self.context(state)
    if proposal is None:
      proposal = self.drafter.propose(drafter_params, state.drafter_state, target, ctx,
                                      key_draft)
    g = proposal.tokens_BG.shape[1]

    # Verify [anchor, d1..dγ] at positions start..start+γ in one target forward.
    anchor_B = state.tokens_BL[rows, state.num_tokens_B - 1]
    start_B = state.cache.lengths_B
    verify_BG1 = jnp.concatenate([anchor_B[:, None], proposal.tokens_BG], axis=1)
    out = target(verify_BG1, cache=state.cache, taps=self.drafter.taps)
    if self.sampling.greedy:
      n_B, emitted_BG1 = greedy_verify(proposal.tokens_BG, proposal.num_proposed_B,
                                       out.logits_BTV)
    else:
      p_BG1V = processed_probs(out.logits_BTV, self.sampling,
                               state.temperature, state.top_p)
      n_B, emitted_BG1 = rejection_verify(key_verify, proposal.tokens_BG,
                                          proposal.num_proposed_B, proposal.q_BGV, p_BG1V)

    # Commit: cut at the first stop token and at max_new_tokens; done rows write nothing.
    live_B = ~state.done_B
    j = jnp.arange(g + 1)[None, :]
    is_stop = jnp.zeros_like(emitted_BG1, bool)
    for sid in self.stop_ids:
      is_stop |= emitted_BG1 == sid
    is_stop &= j <= n_B[:, None]
    first_stop_B = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1), g + 1)
    remaining_B = state.max_new_tokens - state.generated_B()
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

    live = live_B.astype(jnp.int32)
    s = state.stats
    stats = DecodeStats(
        steps_B=s.steps_B + live,
        accept_hist_BG1=s.accept_hist_BG1 + live[:, None] * (
            jnp.arange(s.accept_hist_BG1.shape[1])[None, :] == n_B[:, None]),
        proposed_B=s.proposed_B + live * proposal.num_proposed_B,
        accepted_B=s.accepted_B + live * n_B)
    new_state = state.replace(tokens_BL=tokens_BL, num_tokens_B=num_tokens_B,
                              done_B=done_B, cache=cache, step=state.step + 1, stats=stats)
    dstate = self.drafter.update(drafter_params, state.drafter_state, target,
                                 self.context(new_state), out, start_B, n_B)
    return new_state.replace(drafter_state=dstate)

  def generate_fn(self, target_params, drafter_params, state: DecodeState) -> DecodeState:
    """Runs steps until every row is done, inside one `lax.while_loop`."""
    return jax.lax.while_loop(
        lambda st: ~jnp.all(st.done_B),
        lambda st: self.step_fn(target_params, drafter_params, st),
        state)

  # ---------------------------------------------------------------- jitted entry points

  def prefill(self, target_params, drafter_params, prompt_BP, prompt_len_B, *,
              temperature=0.0, top_p=1.0, max_new_tokens, seed=0) -> DecodeState:
    buffer_len = self.buffer_len(prompt_BP.shape[1], max_new_tokens)
    return _jit_prefill(self, target_params, drafter_params, prompt_BP, prompt_len_B,
                        temperature, top_p, max_new_tokens, seed, buffer_len=buffer_len)

  def step(self, target_params, drafter_params, state, proposal=None) -> DecodeState:
    return _jit_step(self, target_params, drafter_params, state, proposal)

  def generate(self, target_params, drafter_params, state) -> DecodeState:
    return _jit_generate(self, target_params, drafter_params, state)


_jit_prefill = jax.jit(SpeculativeEngine.prefill_fn, static_argnums=0,
                       static_argnames=('buffer_len',))
_jit_step = jax.jit(SpeculativeEngine.step_fn, static_argnums=0, donate_argnums=3)
_jit_generate = jax.jit(SpeculativeEngine.generate_fn, static_argnums=0, donate_argnums=3)
