"""One grammar matcher per constrained row, and the masks of each verify step.

`plan` walks a step's proposal with each row's matcher: the mask of every verify position
(the bonus one included) is the set of tokens allowed after the drafts before it, and
the matcher is rolled back afterwards, so it only ever advances by committed tokens
(`commit`). With `forced_drafts`, where the grammar forces a token (JSON keys and
punctuation) a draft outside the grammar is replaced by it, and past the drafter's own
drafts forced tokens are drafted alone (the engine's `StepMasks` says which law each
draft then has).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import llguidance
import llguidance.numpy
import numpy as np

from dspec.structured.constraints import CompiledConstraint

ALL_ALLOWED = -1   # a bitmask word with every bit set


class _Forced:
  """The tokens the grammar forces from one matcher state on, consumed one at a time."""

  def __init__(self):
    self.tokens, self.at = [], 0

  def next(self, matcher) -> int:
    if self.at >= len(self.tokens):
      self.tokens, self.at = matcher.compute_ff_tokens(), 0
    return self.tokens[self.at] if self.tokens else -1

  def took(self, token: int) -> None:
    """The walk consumed `token`: the rest of the list holds only if it was the forced one."""
    if self.at < len(self.tokens) and self.tokens[self.at] == token:
      self.at += 1
    else:
      self.tokens, self.at = [], 0


class RowConstraints:
  """The matchers of a batch's rows (None: unconstrained) and their host time."""

  def __init__(self, compiled: Sequence[Optional[CompiledConstraint]], batch: int,
               vocab_size: int, forced_drafts: bool = True):
    self.matchers = [c.matcher() if c is not None else None for c in compiled]
    self.matchers += [None] * (batch - len(self.matchers))
    self.words = (vocab_size + 31) // 32
    self.forced_drafts = forced_drafts
    self.host_s = 0.0   # time in the matchers (masks, walks, commits)

  def next_masks(self, done_B: Optional[np.ndarray] = None) -> np.ndarray:
    """[B, W] int32: what each row's next token may be (its first, after the prefill; the
    one after the anchor, in a step: the loop fills it while the device drafts). Rows
    done (`done_B`) or unconstrained: every token."""
    t0 = time.perf_counter()
    allowed_BW = np.full((len(self.matchers), self.words), ALL_ALLOWED, np.int32)
    for b, m in enumerate(self.matchers):
      if m is not None and (done_B is None or not done_B[b]):
        llguidance.numpy.fill_next_token_bitmask(m, allowed_BW, b)
    self.host_s += time.perf_counter() - t0
    return allowed_BW

  def plan(self, tokens_BG: np.ndarray, num_B: np.ndarray, room_B: np.ndarray,
           done_B: np.ndarray, stochastic_q: bool, next_BW: np.ndarray) -> tuple:
    """(drafts [B, G], number of drafts [B], allowed tokens [B, G + 1, W] (packed
    bitmasks), forced tokens [B, G] (-1: none), the drafter's own drafts [B]): the
    fields of the engine's `StepMasks`, for a step whose drafter proposed
    `num_B` of `tokens_BG` (G = its width, which forced drafts may fill). room_B: the most
    drafts each row can verify (its budget). stochastic_q: the drafts were sampled from
    a q of the drafter's (so a position with a forced token needs that token known even
    where the drafter's draft is kept). next_BW: `next_masks()` of this step."""
    t0 = time.perf_counter()
    b, g = tokens_BG.shape
    tokens_BG = np.array(tokens_BG, np.int32)
    num_B = np.array(num_B, np.int32)
    allowed_BGW = np.full((b, g + 1, self.words), ALL_ALLOWED, np.int32)
    allowed_BGW[:, 0] = next_BW
    forced_BG = np.full((b, g), -1, np.int32)
    own_B = np.full((b,), g, np.int32)
    for row, m in enumerate(self.matchers):
      if m is None or done_B[row]:
        continue
      num_B[row], own_B[row] = self._walk(m, tokens_BG[row], int(num_B[row]),
                                          int(min(room_B[row], g)), allowed_BGW[row],
                                          forced_BG[row], stochastic_q)
    self.host_s += time.perf_counter() - t0
    return tokens_BG, num_B, allowed_BGW, forced_BG, own_B

  def _walk(self, m, tokens_G, num: int, room: int, allowed_GW, forced_G,
            stochastic_q: bool) -> tuple:
    """Fills one row's masks (and forced drafts) along its proposal; returns (drafts it
    verifies, how many of them are the drafter's own). A draft the grammar rejects ends
    the proposal there, unless a forced token replaces it; one sampled from a stochastic
    q stays as the last draft instead (the verify rejects it, p = 0 there, and its
    residual max(p - q, 0) is not p: dropping it would change the output's law), where a
    deterministic one's residual is p itself."""
    forced = _Forced()
    consumed = j = 0
    own = min(num, room)
    while True:
      if j:   # position 0's mask: `next_masks`
        llguidance.numpy.fill_next_token_bitmask(m, allowed_GW, j)
      if j >= room or m.is_stopped():
        break
      f = forced.next(m) if self.forced_drafts else -1
      if j < own:
        if stochastic_q:
          forced_G[j] = f
        if m.try_consume_tokens([int(tokens_G[j])]) != 1:
          if f < 0 or m.try_consume_tokens([f]) != 1:
            forced_G[j] = -1   # nothing replaces it here: its law is q
            j += stochastic_q  # verified last (and rejected), or not verified at all
            break
          tokens_G[j] = forced_G[j] = f
      elif f < 0 or m.try_consume_tokens([f]) != 1:
        break
      else:
        tokens_G[j] = forced_G[j] = f
      forced.took(int(tokens_G[j]))
      consumed += 1
      j += 1
    m.rollback(consumed)
    return j, min(j, own)

  def tree_masks(self, tokens_BN: np.ndarray, parents_BN: np.ndarray,
                 num_nodes_B: np.ndarray, done_B: np.ndarray,
                 next_BW: np.ndarray) -> np.ndarray:
    """[B, N, W] packed bitmasks: the tokens allowed after each node of a step's token
    tree (node 0, the anchor: after the committed tokens), walked depth first with the
    matcher and rolled back. A node the grammar rejects is never accepted (p = 0 at its
    parent), so its subtree's masks stay all-ones. Trees draft no forced tokens. next_BW:
    `next_masks()` of this step (node 0's)."""
    t0 = time.perf_counter()
    b, n = tokens_BN.shape
    allowed_BNW = np.full((b, n, self.words), ALL_ALLOWED, np.int32)
    allowed_BNW[:, 0] = next_BW
    for row, m in enumerate(self.matchers):
      if m is None or done_B[row]:
        continue
      children = [[] for _ in range(n)]
      for node in range(1, int(num_nodes_B[row])):
        if 0 <= parents_BN[row, node] < node:
          children[int(parents_BN[row, node])].append(node)
      self._walk_tree(m, tokens_BN[row], children, allowed_BNW[row])
    self.host_s += time.perf_counter() - t0
    return allowed_BNW

  @staticmethod
  def _walk_tree(m, tokens_N, children, allowed_NW) -> None:
    """Fills the masks of the nodes reachable in the grammar (an explicit stack: a tree
    may be a chain deeper than Python's recursion limit)."""
    stack = [(0, 'enter')]
    while stack:
      node, action = stack.pop()
      if action == 'leave':
        m.rollback(1)
        continue
      if node and m.try_consume_tokens([int(tokens_N[node])]) != 1:
        continue
      if node:   # node 0's mask: `next_masks`
        stack.append((node, 'leave'))
        llguidance.numpy.fill_next_token_bitmask(m, allowed_NW, node)
      if not m.is_stopped():
        stack.extend((child, 'enter') for child in reversed(children[node]))

  def commit(self, new_tokens: Sequence[Sequence[int]]) -> None:
    """Advances each row's matcher by the tokens its step committed."""
    t0 = time.perf_counter()
    for m, tokens in zip(self.matchers, new_tokens):
      if m is not None and tokens and not m.is_stopped():
        if not m.consume_tokens([int(t) for t in tokens]):
          raise RuntimeError(f'the target committed tokens its constraint does not allow: '
                             f'{m.get_error()}')
    self.host_s += time.perf_counter() - t0

  def complete(self) -> list:
    """Per row: True when its output is a finished match, False when it stopped inside
    one (e.g. at max_new_tokens), None when unconstrained."""
    return [None if m is None else bool(m.is_accepting() or m.is_stopped())
            for m in self.matchers]
