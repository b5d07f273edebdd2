"""A host-side step loop for drafters that propose on the CPU host (e.g. suffix trees).

Each iteration reads the committed tokens back, lets the host drafter propose, and runs
the same jitted speculative step as the on-device loop with that proposal passed in.
"""

from __future__ import annotations

from typing import Protocol

import jax
import numpy as np

from dspec.decoding.state import Proposal


class HostDrafter(Protocol):
  """Proposes on the host from the committed token lists of every row."""

  num_draft: int

  def start(self, sequences: list) -> None:
    """Called once with each row's committed tokens (the prompts)."""

  def propose(self, sequences: list, live: np.ndarray) -> tuple:
    """Returns (tokens [B, γ] int32, num_proposed [B] int32) for the current sequences."""

  def finish(self, sequences: list) -> None:
    """Called once with the final sequences (e.g. to grow a cross-request cache)."""


def _sequences(state) -> list:
  tokens, nums = jax.device_get((state.tokens_BL, state.num_tokens_B))
  return [tokens[b, :nums[b]].tolist() for b in range(tokens.shape[0])]


def generate_host_loop(engine, target_params, drafter_params, state, host_drafter):
  """Runs `engine.step` until every row is done, proposals coming from `host_drafter`."""
  sequences = _sequences(state)
  host_drafter.start(sequences)
  done = np.asarray(state.done_B)
  while not done.all():
    tokens_BG, num_B = host_drafter.propose(sequences, ~done)
    proposal = Proposal(np.asarray(tokens_BG, np.int32), np.asarray(num_B, np.int32))
    state = engine.step(target_params, drafter_params, state, proposal)
    sequences = _sequences(state)
    done = np.asarray(state.done_B)
  host_drafter.finish(sequences)
  return state
