"""Loop state of AR and speculative decoding (a pytree carried by `lax.while_loop`)."""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple, Optional

import jax.numpy as jnp
from flax import struct

from dspec.models.kv_cache import KVCache


class DraftContext(NamedTuple):
  """Read-only view of the committed sequence handed to drafters.

  tokens_BL: prompt + generated tokens; num_tokens_B: how many are committed (the prefill
  already committed the first generated token). The last committed token is the anchor;
  the target cache holds positions < num_tokens_B - 1.
  """

  tokens_BL: jnp.ndarray
  num_tokens_B: jnp.ndarray
  sampling: Any = None          # SamplingSpec (static), for drafters that sample
  temperature: Any = None
  top_p: Any = None
  remaining_B: Any = None       # tokens each row may still commit (the budget left)


class Proposal(NamedTuple):
  """γ draft tokens per row, how many of them are real, and their proposal probs.

  q_BGV=None means argmax/deterministic proposals (one-hot q in rejection sampling).
  """

  tokens_BG: jnp.ndarray
  num_proposed_B: jnp.ndarray
  q_BGV: Optional[jnp.ndarray] = None

  LOGICAL_AXES = {'tokens_BG': ('batch', None), 'num_proposed_B': ('batch',),
                  'q_BGV': ('batch', None, 'vocab')}


class StepMasks(NamedTuple):
  """A constraint's part in one verify step (structured output, `dspec.structured`).

  allowed_BG1W: per verify position, the packed bitmask of the tokens allowed there (bit
    v % 32 of word v // 32), given the drafts before it.
  forced_BG: per draft position, the token the constraint forces there, or -1. A draft of
    the drafter's own at such a position is kept when allowed and replaced by the forced
    token when not, so its law is q restricted to the allowed tokens plus the rest of q's
    mass on the forced token.
  own_B: how many drafts are the drafter's own; the rest are forced tokens (one-hot q).
  """

  allowed_BG1W: jnp.ndarray
  forced_BG: jnp.ndarray
  own_B: jnp.ndarray


@struct.dataclass
class DecodeStats:
  """Per-row counters from which every metric (docs/DESIGN.md, "Metrics") is derived.

  Verify steps count only while a row is live. `committed_B` counts the tokens verify
  steps committed (after the cut at a stop token or the budget; the token the prefill
  emits is not a verify step's), so τ = committed / steps is exactly what was produced.
  `row0_committed_S` is row 0's committed count at each verify step (acceptance lengths).
  Per draft position k (column k-1): `reached_BG` counts the steps that verified a draft
  there with every earlier draft accepted, `passed_BG` those that also accepted it; their
  ratio is the conditional acceptance P(n >= k | n >= k-1) even when the verify length
  varies from step to step (controller tiers, n-gram misses, per-row lengths).
  """

  steps_B: jnp.ndarray              # verify steps taken while the row was live
  committed_B: jnp.ndarray          # tokens committed by those steps
  accept_hist_BG1: jnp.ndarray      # histogram of accepted drafts per step (0..γ)
  proposed_B: jnp.ndarray           # draft tokens proposed (excludes empty slots)
  accepted_B: jnp.ndarray           # draft tokens accepted
  row0_committed_S: jnp.ndarray     # row 0: tokens committed at verify step s
  reached_BG: jnp.ndarray           # steps that verified position k, drafts < k accepted
  passed_BG: jnp.ndarray            # ... and accepted the draft at position k

  LOGICAL_AXES: ClassVar[dict] = {
      'steps_B': ('batch',), 'committed_B': ('batch',), 'accept_hist_BG1': ('batch', None),
      'proposed_B': ('batch',), 'accepted_B': ('batch',), 'row0_committed_S': (None,),
      'reached_BG': ('batch', None), 'passed_BG': ('batch', None)}

  @classmethod
  def zeros(cls, batch: int, gamma: int, max_steps: int) -> 'DecodeStats':
    z = jnp.zeros((batch,), jnp.int32)
    z_BG = jnp.zeros((batch, gamma), jnp.int32)
    return cls(z, z, jnp.zeros((batch, gamma + 1), jnp.int32), z, z,
               jnp.zeros((max_steps,), jnp.int32), z_BG, z_BG)


@struct.dataclass
class DecodeTrace:
  """Row 0's proposals per verify step (engines built with `trace=True`)."""

  drafts_SG: jnp.ndarray            # the drafted tokens (slots >= num_proposed unused)
  num_proposed_S: jnp.ndarray
  num_accepted_S: jnp.ndarray

  LOGICAL_AXES: ClassVar[dict] = {'drafts_SG': (None, None), 'num_proposed_S': (None,),
                                  'num_accepted_S': (None,)}

  @classmethod
  def zeros(cls, max_steps: int, gamma: int) -> 'DecodeTrace':
    z = jnp.zeros((max_steps,), jnp.int32)
    return cls(jnp.zeros((max_steps, gamma), jnp.int32), z, z)


@struct.dataclass
class TreeTrace:
  """Row 0's token tree per verify step (tree engines built with `trace=True`): node
  tokens and parents (first `num_nodes_S` nodes real), and the accepted path's node ids
  (root first; `num_accepted_S` drafts past it)."""

  tokens_SN: jnp.ndarray
  parents_SN: jnp.ndarray
  num_nodes_S: jnp.ndarray
  path_SD1: jnp.ndarray
  num_accepted_S: jnp.ndarray

  @classmethod
  def zeros(cls, max_steps: int, num_nodes: int, max_depth: int) -> 'TreeTrace':
    z = jnp.zeros((max_steps,), jnp.int32)
    z_SN = jnp.zeros((max_steps, num_nodes), jnp.int32)
    return cls(z_SN, z_SN, z, jnp.zeros((max_steps, max_depth + 1), jnp.int32), z)


@struct.dataclass
class DecodeState:
  """Everything one decoding loop carries; static knobs live in the engine."""

  tokens_BL: jnp.ndarray        # prompt + generated tokens
  num_tokens_B: jnp.ndarray     # committed tokens per row
  prompt_len_B: jnp.ndarray
  done_B: jnp.ndarray
  cache: KVCache                # target cache: holds positions < num_tokens_B - 1
  drafter_state: Any
  key: jnp.ndarray
  step: jnp.ndarray             # scalar loop counter
  temperature: jnp.ndarray      # runtime sampling values (no recompiles)
  top_p: jnp.ndarray
  max_new_tokens: jnp.ndarray   # scalar
  stats: DecodeStats
  trace: Optional[DecodeTrace | TreeTrace] = None

  LOGICAL_AXES: ClassVar[dict] = {
      'tokens_BL': ('batch', None), 'num_tokens_B': ('batch',), 'prompt_len_B': ('batch',),
      'done_B': ('batch',), 'key': (), 'step': (), 'temperature': (), 'top_p': (),
      'max_new_tokens': ()}

  def generated_B(self):
    return self.num_tokens_B - self.prompt_len_B
