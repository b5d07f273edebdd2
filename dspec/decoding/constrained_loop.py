"""The host loop of structured output: every step's masks come from the rows' matchers.

Each step: the device drafter proposes (`SpeculativeEngine.propose`; a host drafter
proposes on the host instead), the host walks the proposal with each constrained row's
matcher (`RowConstraints.plan`: one mask per verify position, forced drafts, proposals
cut where the grammar rejects them), the device verifies against the masked, renormalised
target (`SpeculativeEngine.masked_step`) at the width the longest proposal left needs
(`host_loop.verify_width`: a cut proposal does not pay for the drafter's full width), and
the matchers advance by what was committed. A `TreeEngine` drafts its tree on the device
(`TreeEngine.propose`), the host walks every node with the matchers
(`RowConstraints.tree_masks`) and the tree is verified against the masked target
(`TreeEngine.masked_step`). Plain AR (`NoDrafter`) runs the same loop
with one verify position: that is constrained AR, the reference the speculative output
equals (T = 0) or matches in distribution (T > 0).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import numpy as np

from dspec import distributed
from dspec.decoding.host_loop import HostEngine, verify_width
from dspec.decoding.prompts import read_committed, row_tokens
from dspec.decoding.state import Proposal, StepMasks
from dspec.decoding.tree_engine import TreeEngine
from dspec.structured.matcher import RowConstraints


@dataclasses.dataclass
class Constrained:
  """A generation's constraints: one compiled constraint (or None) per row, whether forced
  tokens are drafted, and the matchers of its last run (`start`)."""

  compiled: tuple
  vocab_size: int
  forced_drafts: bool = True
  last: Optional[RowConstraints] = None

  def start(self, batch: int) -> RowConstraints:
    self.last = RowConstraints(self.compiled, batch, self.vocab_size, self.forced_drafts)
    return self.last


def generate_constrained(engine, target_params, drafter_params, state,
                         rows: RowConstraints):
  """Decodes `state` (a prefill whose first tokens `rows.next_masks()` restricted) to the
  end under `rows`' constraints; returns the final state. A `HostEngine`'s host drafter
  (started by its prefill) proposes instead of the device drafter."""
  host = engine if isinstance(engine, HostEngine) else None
  host_drafter = host and host.session.drafter
  engine = host.engine if host else engine
  tokens, num, done, prompt_len_B, max_new = distributed.host_values((
      state.tokens_BL, state.num_tokens_B, state.done_B, state.prompt_len_B,
      state.max_new_tokens))
  sequences = row_tokens(tokens, num)
  rows.commit([[seq[-1]] for seq in sequences])   # the prefill's token
  if isinstance(engine, TreeEngine):
    while not np.all(done):
      state, tree = engine.propose(target_params, drafter_params, state)
      next_BW = rows.next_masks(done)   # while the device drafts
      allowed_BNW = rows.tree_masks(*distributed.host_values(
          (tree.tokens_BN, tree.parents_BN, tree.num_nodes_B)), done, next_BW)
      state = engine.masked_step(target_params, drafter_params, state, tree,
                                 jax.device_put(allowed_BNW))
      num, done = _commit(state, sequences, num, rows)
    return state
  while not np.all(done):
    if host_drafter is not None:
      next_BW = rows.next_masks(done)
      tokens_BG, num_B = host_drafter.propose(sequences, ~done)
      q_BGV, synced = None, False
    else:
      state, proposal = engine.propose(target_params, drafter_params, state)
      next_BW = rows.next_masks(done)   # while the device drafts
      tokens_BG, num_B = distributed.host_values((proposal.tokens_BG,
                                                  proposal.num_proposed_B))
      q_BGV, synced = proposal.q_BGV, True
    room_B = max_new - (num - prompt_len_B)
    tokens_BG, num_B, allowed_BGW, forced_BG, own_B = rows.plan(
        tokens_BG, num_B, room_B, done, stochastic_q=q_BGV is not None, next_BW=next_BW)
    g = verify_width(int(np.max(np.where(done, 0, num_B))), engine.num_draft)
    if q_BGV is not None and g < q_BGV.shape[1]:
      q_BGV = q_BGV[:, :g]
    proposal = Proposal(*jax.device_put((tokens_BG[:, :g], num_B)), q_BGV)
    masks = StepMasks(*jax.device_put((allowed_BGW[:, :g + 1], forced_BG[:, :g],
                                       np.minimum(own_B, g))))
    state = engine.masked_step(target_params, drafter_params, state, proposal, masks,
                               synced=synced)
    num, done = _commit(state, sequences, num, rows)
  if host is not None:
    host.finish(state)
  return state


def _commit(state, sequences, num, rows: RowConstraints) -> tuple:
  """Reads the step's committed tokens back into `sequences` and advances the matchers by
  them; returns (tokens per row, done per row)."""
  before = num
  num, done = read_committed(state, sequences, num)
  rows.commit([seq[len(seq) - (n - m):] for seq, n, m in zip(sequences, num, before)])
  return num, done

