"""Engines whose drafts come from the host (suffix trees): `HostEngine` and its session.

Each step the host drafter proposes from its copy of the committed tokens, the chain engine
verifies at the width the longest proposal needs (`verify_width`) and the host reads back
what was committed. Under `verify_length=auto` these steps are the controller's positive
tiers, judged in retrospect by `HostSession.judge` (the host twin of
`estimate.retrospective_match`); tier 0 is plain AR.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import numpy as np

from dspec import distributed
from dspec.decoding.prompts import read_committed, row_tokens
from dspec.decoding.state import Proposal


def verify_width(longest: int, num_draft: int) -> int:
  """Drafts verified by a step whose longest proposal is `longest`: the next power of two
  (one compiled step per width; at least 1), at most `num_draft`."""
  return min(1 << max(longest - 1, 0).bit_length(), num_draft)


def full_proposal(batch: int, width: int) -> Proposal:
  """`width` drafts (token 0) per row, on device (warm-up, profiling)."""
  return jax.device_put(Proposal(np.zeros((batch, width), np.int32),
                                 np.full((batch,), width, np.int32)))


class HostSession:
  """One generation's host drafter and its copy of each row's committed tokens."""

  def __init__(self, drafter, prompt_BP, prompt_len_B):
    self.drafter = drafter
    self.num_B = np.array(prompt_len_B)
    self.sequences = row_tokens(np.asarray(prompt_BP), self.num_B)
    drafter.start(self.sequences)

  def sync(self, state) -> np.ndarray:
    """Appends what `state` committed since the last sync; returns its done_B."""
    self.num_B, done_B = read_committed(state, self.sequences, self.num_B)
    return done_B

  def propose(self, live_B: np.ndarray, width: int) -> Proposal:
    """The host drafter's proposal for the current sequences, at most `width` drafts and
    verified at `verify_width` of its longest, on device."""
    tokens_BG, num_B = self.drafter.propose(self.sequences, live_B)
    num_B = np.where(live_B, np.minimum(num_B, width), 0).astype(np.int32)
    w = verify_width(int(np.max(num_B, initial=0)), width)
    return jax.device_put(Proposal(np.asarray(tokens_BG, np.int32)[:, :w], num_B))

  def judge(self, since_B, width: int) -> tuple:
    """Shadow samples [B, width] judged in retrospect over each row's tokens after
    since_B (at most its last `width` lengths): the host drafter proposes at the walk's
    length, the step commits the drafts matching what was committed plus one token, and
    so on (`estimate.retrospective_match`'s walk). Returns (accepted, judged, proposed)."""
    ends_B = np.array([len(seq) for seq in self.sequences])
    at_B = np.maximum(np.maximum(np.asarray(since_B), ends_B - width), 1)
    views = [seq[:a] for seq, a in zip(self.sequences, at_B)]
    accepted, judged = (np.zeros((len(views), width), np.int64) for _ in range(2))
    proposed = np.zeros((len(views), width), bool)
    for s in range(width):
      live_B = at_B < ends_B
      if not live_B.any():
        break
      draft_BG, num_B = self.drafter.propose(views, live_B)
      for b in np.flatnonzero(live_B):
        seq, at = self.sequences[b], at_B[b]
        judged[b, s] = min(ends_B[b] - at, draft_BG.shape[1])
        n = 0
        while n < min(num_B[b], judged[b, s]) and draft_BG[b, n] == seq[at + n]:
          n += 1
        accepted[b, s], proposed[b, s] = n, num_B[b] > 0
        views[b].extend(seq[at:at + n + 1])
        at_B[b] += n + 1
    return accepted, judged, proposed


class HostEngine:
  """The engine protocol over a chain `engine` drafting on the host (`host_factory()`: a
  host drafter per generation, started while the device prefills). `width` caps a step's
  drafts; the controller's tiers share one session (`with_width`)."""

  adaptive = False
  row0_tiers = None

  def __init__(self, engine, host_factory: Callable, width: Optional[int] = None,
               shared: Optional[dict] = None):
    self.engine = engine
    self.width = width or engine.num_draft
    self.shared = {'factory': host_factory} if shared is None else shared

  def with_width(self, width: int) -> 'HostEngine':
    return HostEngine(self.engine, None, width, self.shared)

  def use_factory(self, host_factory: Callable) -> None:
    """Later generations take their host drafters from `host_factory`."""
    self.shared['factory'] = host_factory

  host = property(lambda self: self)   # as the controller's: the engine holding the session
  session = property(lambda self: self.shared['session'])
  num_draft = property(lambda self: self.width)
  drafter = property(lambda self: self.engine.drafter)
  sampling = property(lambda self: self.engine.sampling)
  buffer_len = property(lambda self: self.engine.buffer_len)
  tier_steps = staticmethod(dict)   # fixed verification: no tiers

  def prefill(self, target_params, drafter_params, prompt_BP, prompt_len_B, **kw):
    state = self.engine.prefill(target_params, drafter_params, prompt_BP, prompt_len_B, **kw)
    self.shared['session'] = HostSession(self.shared['factory'](), prompt_BP, prompt_len_B)
    return state

  def warm(self, target_params, drafter_params, state) -> None:
    """Compiles and runs, on copies of `state`, the step at every verify width not warm
    yet: no generation compiles mid-way, nor times a first run as a step."""
    marks = self.engine.warm_marks(state.tokens_BL.shape)
    widths = {verify_width(n, self.width) for n in range(self.width + 1)} - marks
    copy = lambda: jax.tree.map(lambda x: x.copy(), state)
    jax.block_until_ready([self.engine.step(target_params, drafter_params, copy(), full_proposal(
        state.tokens_BL.shape[0], w)) for w in widths])
    marks.update(widths)

  def run(self, target_params, drafter_params, state, max_steps: Optional[int] = None, *,
          force_wide: bool = False):
    """Host-proposed steps until every row is done or `max_steps` ran; `force_wide`
    (profiling) verifies full proposals and leaves the session alone."""
    read = (lambda st: distributed.host_values(st.done_B)) if force_wide else self.session.sync
    done_B, steps = read(state), 0
    while not done_B.all() and (max_steps is None or steps < max_steps):
      proposal = (full_proposal(len(done_B), self.width) if force_wide
                  else self.session.propose(~done_B, self.width))
      state = self.engine.step(target_params, drafter_params, state, proposal)
      done_B, steps = read(state), steps + 1
    return state

  def generate(self, target_params, drafter_params, state):
    self.warm(target_params, drafter_params, state)
    return self.finish(self.run(target_params, drafter_params, state))

  def finish(self, state):   # the host drafter sees the final sequences
    self.session.sync(state)
    self.session.drafter.finish(self.session.sequences)
    return state
