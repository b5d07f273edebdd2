"""A host-side step loop for drafters that propose on the CPU host (e.g. suffix trees).

Each iteration lets the host drafter propose from its copy of the committed tokens, runs
the engine's jitted step with that proposal, and reads back only what the step committed
(at most γ + 1 tokens per row, plus the counters), never the whole token buffer. The step
verifies only as many positions as the longest proposal needs, rounded up to a power of
two (`verify_width`): host drafters' proposals vary in length (a suffix match of m tokens
drafts at most m), and a short one need not pay for γ positions.

With `fallback` (an `ARFallback`: an engine over the same state that verifies nothing,
i.e. plain AR), a drafter that stops paying stops costing a host round trip per token:
after `patience` steps in a row that did not pay for themselves (committed no more tokens
per live row than a step costs in AR steps: empty proposals, rejected ones, or ones
accepted too short to pay) the loop runs AR chunks on device (`chunk` steps, doubling up
to `max_chunk`). Each chunk read back is judged in retrospect on the host, with no device
work: the drafter's proposal at every committed length of the chunk's last `walk_tail`
tokens is walked against what AR committed, as verify steps would have taken it (for a
point-mass draft, AR sampling the draft token has the acceptance probability). The
verdict is about now, and on a CPU the host's work shares the cores with the device's.
Once a walk took no draft at all (is quiet), or once none of the fallback's recent chunk
judges earned a step that paid for itself (`ARFallback.judges_barren`, at T > 0 only:
walks that take a few drafts there rarely precede a stretch that pays), the chunks grow
4× instead of 2×, and each is queued behind the one before it, which is then read back
and judged while the device runs it (the device never waits on the host between them;
their verdict acts a chunk late; none under a chunk that ends the generation, where it
could not act): at B = 1 a device call and an idle wait each cost about an AR step's
share of host time, so fewer calls and no waits are what AR parity needs.
Speculation resumes when the walk's tokens per step beat the cost of a speculative step
in AR steps: `step_cost`, or else the median wall time of the loop's recent speculative
steps over that of its recent AR tokens, kept by the `ARFallback` across generations
(`ARFallback.price` times one of each before the first). A walk that took too few drafts
but whose last step took one earns one speculative step now (a paying stretch may be
starting where it ended), unless the recent judges were barren (their tries did not pay);
other walks, no step: scattered acceptances at T > 0 do not buy tries.
A step whose rejection sends the loop to AR (such a try, or a stretch's last unpaid step)
carries the AR chunk along in the same device call (`ARFallback.try_then_run`: the chunk
runs only if no row accepted a draft; one accepted too short to pay runs it in the next
call), so a rejected try costs its verify, not a round trip.
A proposal that could not pay for its step even if accepted whole (1 + its longest draft
at most the step's price; an empty one, always) is not verified: no try then (AR chunks),
and in a stretch an AR step, an unpaid one (a verify of width 1 costs ~3 AR steps here).
The prompts are judged so before the first step (`start_host_drafter`), but earn no try:
the prompt is not the target's output, and the first AR chunk is judged right away. Nor
is a prompt's walk taken at its word: its tokens per step are scaled by what the stretches
that earlier prompts earned realised against their walks' prediction (`ARFallback`'s
`prompt_realised`, an average capped at 1, kept across generations; a prompt's own text
overstates what the target's samples accept at T > 0).
"""

from __future__ import annotations

import collections
import functools
import statistics
import time
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from dspec.decoding.drafter import TruncatedDrafter
from dspec.decoding.engine import device_scalar
from dspec.decoding.policy import ControllerConfig
from dspec.decoding.prompts import row_tokens
from dspec.decoding.state import Proposal


class ARFallback:
  """The host loop's plain-AR engine (`engine` verifying nothing) and the loop's recent
  wall times (a speculative step; an AR token), kept across generations."""

  def __init__(self, engine, window: int = 64, judge_window: int = 16):
    self.engine = engine
    self.step_s = collections.deque(maxlen=window)
    self.ar_token_s = collections.deque(maxlen=window)
    self.prompt_realised = 1.0   # EMA of realised / predicted tokens per prompt-earned step
    # Per AR-chunk judge: whether it earned a verified step that paid for itself (more
    # tokens per live row than a step's cost in AR steps).
    self.judges_earned = collections.deque(maxlen=judge_window)

  def judges_barren(self) -> bool:
    """Whether none of the last `judge_window` AR-chunk judges earned a step that paid
    for itself (a full window), at T > 0: the loop then takes every walk as quiet, and a
    walk earns no try. Never at T = 0: a walk is then exactly what verify steps would have
    taken, and walks taken as quiet would leave unjudged a stretch that pays from
    mid-generation (the window, filled by earlier prompts that never paid, would keep
    every later generation AR)."""
    earned = self.judges_earned
    return (not self.engine.sampling.greedy and len(earned) == earned.maxlen
            and not any(earned))

  def realised_after_prompt(self, predicted: float, tokens: int, steps: int) -> None:
    """Adds a prompt-earned stretch (`tokens` committed by live rows in `steps` row-steps,
    where the prompt's walk predicted `predicted` per step) to the calibration: its ratio,
    capped at 1, averaged in with weight 1/2."""
    if steps:
      self.prompt_realised = 0.5 * (self.prompt_realised +
                                    min(tokens / steps / max(predicted, 1e-9), 1.0))

  @classmethod
  def of(cls, engine) -> 'ARFallback':
    """The fallback of a speculative engine: the same engine drafting nothing."""
    return cls(engine.with_drafter(TruncatedDrafter(engine.drafter, 0)))

  def run(self, *args, **kwargs):
    return self.engine.run(*args, **kwargs)

  def try_then_run(self, engine, target_params, drafter_params, state, proposal,
                   max_steps: int):
    """`engine.step` verifying `proposal`, then up to `max_steps` AR steps unless some row
    accepted a draft, in one device call; (state, whether a draft was accepted)."""
    return _try_then_run(engine, self.engine)(target_params, drafter_params, state,
                                              proposal, device_scalar(int(max_steps)))

  def price(self, engine, target_params, drafter_params, state, ar_steps: int = 8) -> None:
    """Times a step of `engine` verifying a full proposal, and `ar_steps` AR steps in one
    call, on copies of `state` (compiled already: `compile_step_widths`), unless a step was
    timed before: the first generation then prices its steps as later ones do (not at 1 AR
    step, which makes every prompt's walk earn speculation)."""
    if self.step_s:
      return
    full = _full_proposal(state.tokens_BL.shape[0], engine.num_draft)
    for run, record, n in (
        (lambda s: engine.step(target_params, drafter_params, s, full), self.step_s, 1),
        (lambda s: self.engine.run(target_params, drafter_params, s, ar_steps),
         self.ar_token_s, ar_steps)):
      copy = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), state))
      t = time.perf_counter()
      jax.block_until_ready(run(copy))
      record.append((time.perf_counter() - t) / n)

  def step_cost(self) -> float:
    """A speculative step's cost in AR tokens (medians; 1.0 until both were timed)."""
    if not self.step_s or not self.ar_token_s:
      return 1.0
    return statistics.median(self.step_s) / statistics.median(self.ar_token_s)


def _full_proposal(batch: int, width: int) -> Proposal:
  """`width` drafts (token 0) for each of `batch` rows, on device: a step that runs every
  path of its verify (warm-up, pricing)."""
  return jax.device_put(Proposal(np.zeros((batch, width), np.int32),
                                 np.full((batch,), width, np.int32)))


@functools.lru_cache(maxsize=64)
def _try_then_run(engine, ar_engine):
  """The program of `ARFallback.try_then_run` (the state is donated)."""
  def try_then_run(target_params, drafter_params, state, proposal, max_steps):
    before_B = state.num_tokens_B
    state = engine.step_fn(target_params, drafter_params, state, proposal)
    paid = jnp.any(state.num_tokens_B - before_B > 1)
    return ar_engine.run_fn(target_params, drafter_params, state,
                            jnp.where(paid, 0, max_steps)), paid
  return jax.jit(try_then_run, donate_argnums=2)


@functools.partial(jax.jit, static_argnums=2)
def _committed_since(state, since_B, width: int):
  """(tokens at since_B + 0..width-1 [B, width], num_tokens_B, done_B)."""
  b, length = state.tokens_BL.shape
  idx_BW = jnp.minimum(since_B[:, None] + jnp.arange(width)[None, :], length - 1)
  return state.tokens_BL[jnp.arange(b)[:, None], idx_BW], state.num_tokens_B, state.done_B


def read_window(engine, max_chunk: int) -> int:
  """The read-back's width: the most a call of the loop commits per row (a step with every
  draft accepted, then an AR chunk). One width: one compiled read-back, compiled before the
  loop (`compile_step_widths`), so none lands in the loop's step or AR timings."""
  return engine.num_draft + 1 + max_chunk


def _queue_read_back(state, num, width):
  """The read-back of what was committed since `num` (at most `width` per row), queued on
  the device (`_take_read_back` fetches it)."""
  return _committed_since(state, jax.device_put(np.asarray(num, np.int32)), width)


def _take_read_back(queued, sequences, num):
  """Appends a queued read-back's tokens (committed since `num`) to `sequences`; returns
  (num, done)."""
  new_BW, new_num, done = jax.device_get(queued)
  for b, seq in enumerate(sequences):
    seq.extend(new_BW[b, :new_num[b] - num[b]].tolist())
  return new_num, done


def read_back(state, sequences, num, width):
  """Appends what was committed since `num` (at most `width` per row) to `sequences`;
  returns (num, done)."""
  return _take_read_back(_queue_read_back(state, num, width), sequences, num)


class Walk(NamedTuple):
  """What verify steps would have taken over each row's tokens (`judge_in_retrospect`):
  steps, tokens, and the tokens of the last step that had room to take a draft."""

  steps_B: np.ndarray
  tokens_B: np.ndarray
  last_taken_B: np.ndarray

  def took_drafts(self) -> bool:
    return bool(np.any(self.tokens_B > self.steps_B))


def judge_in_retrospect(host_drafter, sequences, since_B, tail: Optional[int] = None) -> Walk:
  """The `Walk` verify steps would have taken over each row's tokens after since_B (with
  `tail`, over at most its last `tail` tokens: the verdict is about now): from length
  since_b, the drafter proposes on the sequence so far, the step commits the proposal's
  prefix matching what was committed plus one token, and so on to the end. `propose` sees
  each row's sequence grow monotonically, as in decoding."""
  if tail is not None:
    since_B = [max(n, len(seq) - tail) for seq, n in zip(sequences, since_B)]
  views = [seq[:n] for seq, n in zip(sequences, since_B)]
  ends_B = np.array([len(seq) for seq in sequences])
  walk = Walk(*(np.zeros(len(sequences), np.int64) for _ in range(3)))
  while True:
    at_B = np.array([len(v) for v in views])
    live_B = at_B < ends_B
    if not live_B.any():
      return walk
    draft_BG, num_B = host_drafter.propose(views, live_B)
    for b in np.flatnonzero(live_B):
      seq, at = sequences[b], at_B[b]
      draft = np.asarray(draft_BG[b, :num_B[b]]).tolist()
      matched = 0
      while matched < len(draft) and at + matched < ends_B[b] and \
          draft[matched] == seq[at + matched]:
        matched += 1
      taken = min(matched + 1, ends_B[b] - at)
      views[b].extend(seq[at:at + taken])
      walk.steps_B[b] += 1
      walk.tokens_B[b] += taken
      if ends_B[b] - at > 1:   # a step with one token to go cannot show a match
        walk.last_taken_B[b] = taken


def start_host_drafter(host_drafter, prompts, judge: bool,
                       tail: int = 64) -> Optional[Walk]:
  """`host_drafter.start(prompts)`; with `judge`, its proposals are then judged in
  retrospect over each prompt's last `tail` tokens (`judge_in_retrospect`; its state is
  built up to there by the first proposal), and that walk returned, else None."""
  host_drafter.start(prompts)
  if judge:
    return judge_in_retrospect(host_drafter, prompts, [min(1, len(p)) for p in prompts], tail)
  return None


def verify_width(longest: int, num_draft: int) -> int:
  """Drafts verified by a step whose longest proposal is `longest`: the next power of two
  (one compiled step per width; at least 1), at most `num_draft`. On a CPU a step's cost
  grows with its width: a short proposal need not pay for `num_draft` positions."""
  return min(1 << max(longest - 1, 0).bit_length(), num_draft)


_KNOBS = ControllerConfig()   # the loop's defaults: `--config.controller.host_*`


def compile_step_widths(engine, target_params, drafter_params, state,
                        fallback: Optional[ARFallback] = None,
                        max_chunk: int = _KNOBS.host_max_chunk) -> None:
  """Compiles and runs `engine.step` (with `fallback`, also its `try_then_run` and AR
  chunk) at every `verify_width` not compiled yet, and the read-back of the loop's
  `max_chunk`, before the loop (the runner calls it; the loop alone compiles each when
  first used): no generation then compiles mid-way. Each runs once on a copy of `state`
  with a full proposal and an AR step, and is waited for: XLA:CPU's first run of a
  program's verify or AR loop costs more than later runs, and so do runs still
  queued on the device when the loop starts; the loop's timings would keep either as the
  price of a step."""
  ar_engine = None if fallback is None else fallback.engine
  marks = engine.warm_marks(state.tokens_BL.shape)   # dropped with the programs
  compiled = {w for a, w in marks if a == ar_engine}
  widths = {verify_width(n, engine.num_draft) for n in range(engine.num_draft + 1)}
  b = state.tokens_BL.shape[0]
  copy = lambda: jax.tree.map(lambda x: x.copy(), state)
  runs = []
  if widths - compiled:
    runs.append(_committed_since(state, jax.device_put(np.zeros((b,), np.int32)),
                                 read_window(engine, max_chunk)))   # as `read_back`
    if fallback is not None:   # its AR chunks' program
      runs.append(fallback.engine.run(target_params, drafter_params, copy(), 1))
  for width in sorted(widths - compiled):
    full = _full_proposal(b, width)
    runs.append(engine.step(target_params, drafter_params, copy(), full))
    if ar_engine is not None:
      runs.append(_try_then_run(engine, ar_engine)(target_params, drafter_params, copy(),
                                                   full, device_scalar(1)))
    marks.add((ar_engine, width))
  jax.block_until_ready(runs)   # else they run on into the caller's timed loop


def walk_rate(walk: Walk) -> float:
  """Tokens per step of a walk."""
  return float(walk.tokens_B.sum() / max(walk.steps_B.sum(), 1))


def _unpaid_after(walk: Walk, cost: float, patience: int, scale: float = 1.0,
                  tries: bool = True) -> int:
  """The loop's count of unpaid steps after judging a walk: 0 (speculate) when its tokens
  per step (times `scale`) beat `cost`; with `tries`, patience - 1 (one try) when its last
  step took a draft (a paying stretch may be starting where the walk ended); else
  patience."""
  if walk_rate(walk) * scale > max(cost, 1):
    return 0
  return patience - 1 if tries and np.any(walk.last_taken_B > 1) else patience


def generate_host_loop(engine, target_params, drafter_params, state, host_drafter, *,
                       fallback=None, patience: int = _KNOBS.host_patience,
                       chunk: int = _KNOBS.host_chunk, max_chunk: int = _KNOBS.host_max_chunk,
                       walk_tail: int = _KNOBS.host_walk_tail,
                       step_cost: Optional[float] = None, started: bool = False,
                       prompt_walk: Optional[Walk] = None):
  """Runs `engine.step` until every row is done, proposals coming from `host_drafter`
  (with `fallback`, AR chunks while it stops paying; module docstring; each chunk's walk
  covers at most its last `walk_tail` tokens). `step_cost`: a speculative step's cost in
  AR steps (None: `fallback.step_cost()`). `started`: its `start` already saw the prompts
  (the runner calls it while the device prefills), and `prompt_walk` is what judging them
  returned (`start_host_drafter`)."""
  tokens, num, done, prompt_len_B, max_new_B = jax.device_get((
      state.tokens_BL, state.num_tokens_B, state.done_B, state.prompt_len_B,
      state.max_new_tokens))
  sequences = row_tokens(tokens, num)
  budget_B = prompt_len_B + max_new_B   # each row's length when done (or a stop token)
  window = read_window(engine, max_chunk)
  if not started:
    prompt_walk = start_host_drafter(host_drafter, sequences, judge=fallback is not None)
  cost = lambda: fallback.step_cost() if step_cost is None else step_cost
  verdict = lambda walk, scale=1.0, tries=True: _unpaid_after(walk, cost(), patience,
                                                              scale, tries)

  def judge(since_B):
    """(unpaid, quiet: the walk took no draft, or the recent judges were barren) after
    judging the AR chunk committed after since_B (barren: no try)."""
    nonlocal pending
    barren = fallback.judges_barren()
    walk = judge_in_retrospect(host_drafter, sequences, since_B, walk_tail)
    unpaid_after = verdict(walk, tries=not barren)
    pending = unpaid_after < patience   # else it earned nothing
    if not pending:
      fallback.judges_earned.append(False)
    return unpaid_after, not walk.took_drafts() or barren

  def paid_for(tokens, rows) -> bool:
    """Whether a step that committed `tokens` over `rows` live rows paid for itself: more
    tokens per row than a step costs in AR steps."""
    return bool(tokens > max(cost(), 1) * max(rows, 1))

  def resolve(paid):
    """Records whether the step a chunk judge earned (if pending) paid for itself."""
    nonlocal pending
    if pending:
      fallback.judges_earned.append(paid)
      pending = False

  unpaid, ar_chunk, quiet = 0, chunk, False
  pending = False   # a chunk judge earned a step not yet verified (`resolve`)
  earned = None   # [predicted, tokens, row-steps] of the stretch the prompt's walk earned
  if fallback is not None and prompt_walk is not None:
    # The prompt is not the target's output: its walk earns speculation, never a try, at
    # its rate scaled by what such stretches realised before (`prompt_realised`).
    unpaid = 0 if verdict(prompt_walk, fallback.prompt_realised) == 0 else patience
    quiet = not prompt_walk.took_drafts() or fallback.judges_barren()
    if unpaid == 0:
      earned = [walk_rate(prompt_walk), 0, 0]
  queued = None   # (read-back, dispatch time) of a quiet AR chunk, taken during the next
  taken_at = 0.0  # when the last AR chunk was taken (a queued chunk starts after it)

  def count_earned(tokens, row_steps):
    """Adds a call's committed tokens and live row-steps to the prompt-earned stretch."""
    if earned is not None:
      earned[1] += int(tokens)
      earned[2] += int(row_steps)

  def end_earned():
    """Ends the prompt-earned stretch (the first AR chunk, or the end) and prices it."""
    nonlocal earned
    if earned is not None:
      fallback.realised_after_prompt(*earned)
      earned = None

  def take_ar_chunk(queued_read, dispatched):
    """Takes an AR chunk's read-back and times its tokens (from its dispatch, or the last
    chunk's end when it was queued behind it); returns since_B."""
    nonlocal num, done, taken_at
    before = num
    num, done = _take_read_back(queued_read, sequences, num)
    started, taken_at = max(dispatched, taken_at), time.perf_counter()
    fallback.ar_token_s.append((taken_at - started) / max(np.max(num - before), 1))
    return before

  def after_ar_chunk(before):
    """Judges the AR chunk committed after `before` (unless quiet: then the next chunk is
    queued and this one judged while it runs); returns the next chunk's length."""
    nonlocal unpaid, quiet
    if unpaid >= patience and not done.all() and not quiet:
      unpaid, quiet = judge(before)
    return chunk if unpaid == 0 else min((4 if quiet else 2) * ar_chunk, max_chunk)

  while not done.all():
    t0 = time.perf_counter()
    if fallback is not None and unpaid >= patience:
      end_earned()
      state = fallback.run(target_params, drafter_params, state, ar_chunk)
      # The last chunk, if queued: taken, and judged while this one runs (unless this one
      # ends the generation).
      before = None if queued is None else take_ar_chunk(*queued)
      remaining = np.max(np.where(done, 0, budget_B - num))
      if before is not None and ar_chunk < remaining:
        unpaid, quiet = judge(before)
      queued = (_queue_read_back(state, num, window), t0)
      if quiet and unpaid >= patience and ar_chunk < remaining:
        ar_chunk = min(4 * ar_chunk, max_chunk)   # queued behind this one: no device idle
        continue
      ar_chunk = after_ar_chunk(take_ar_chunk(*queued))
      queued = None
      continue
    quiet = False
    tokens_BG, num_B = host_drafter.propose(sequences, ~done)
    longest = int(np.max(num_B, initial=0))
    before, live = num, ~done
    if fallback is not None and 1 + longest <= cost():
      # Not even accepted whole would this proposal pay for a step: no try (AR chunks
      # next), or one AR step in a stretch.
      if unpaid == patience - 1:
        unpaid = patience
        resolve(False)
        continue
      state = fallback.run(target_params, drafter_params, state, 1)
      num, done = read_back(state, sequences, num, window)
      count_earned(np.sum(num - before), live.sum())
      unpaid += 1
      continue
    width = verify_width(longest, engine.num_draft)
    proposal = jax.device_put(Proposal(np.asarray(tokens_BG, np.int32)[:, :width],
                                       np.asarray(num_B, np.int32)))
    if fallback is not None and unpaid == patience - 1:
      # A rejected proposal sends the loop to AR: the AR chunk runs in the same call.
      state, accepted = fallback.try_then_run(engine, target_params, drafter_params, state,
                                              proposal, ar_chunk)
      num, done = read_back(state, sequences, num, window)
      elapsed, committed = time.perf_counter() - t0, np.max(num - before)
      accepted = bool(accepted)   # a row accepted a draft: the AR chunk ran no step
      step_tokens = np.sum(num - before) if accepted else live.sum()
      count_earned(step_tokens, live.sum())
      paid = paid_for(step_tokens, live.sum())
      resolve(paid)
      if accepted:   # the call's time is the step's
        fallback.step_s.append(elapsed)
      if paid:
        unpaid = 0
        continue
      end_earned()
      unpaid = patience   # AR chunks: this call's (if it ran one: judged now), or the next
      if not accepted:   # each live row committed one token at the step, then the chunk's
        if fallback.step_s and committed > 1:   # the chunk's time: the call's less a step's
          fallback.ar_token_s.append(
              (elapsed - statistics.median(fallback.step_s)) / (committed - 1))
        ar_chunk = after_ar_chunk(before + live)
      continue
    state = engine.step(target_params, drafter_params, state, proposal)
    num, done = read_back(state, sequences, num, window)
    if fallback is not None:
      fallback.step_s.append(time.perf_counter() - t0)
      count_earned(np.sum(num - before), live.sum())
      paid = paid_for(np.sum(num - before), live.sum())
      resolve(paid)
      unpaid = 0 if paid else unpaid + 1
  end_earned()
  host_drafter.finish(sequences)
  return state
