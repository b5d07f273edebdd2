"""The drafter protocol every proposal method implements.

A drafter is a frozen (hashable) dataclass holding only static knobs; its weights and its
per-sequence state are pytrees passed in and out, so one jitted speculative step serves
every drafter:

  state = drafter.init(params, target, ctx, prefill_out)
  state = drafter.sync(params, state, target, ctx)
  proposal = drafter.propose(params, state, target, ctx, key)     # or propose_prefix
  state = drafter.update(params, state, target, ctx, verify_out, start_B, num_accepted_B)

`ctx` is the committed sequence (`DraftContext`); `prefill_out` / `verify_out` are the target
`TargetOutput`s (logits, post-norm hidden, requested taps). `update` sees the context after
commit: verify position j (0..γ) sits at absolute position start_B + j and the first
num_accepted_B + 1 of them are now committed. At the verify-length controller's tier 0
(plain AR) the engine calls `idle_update` instead: a drafter whose update is costly (MTP's
catch-up through every depth, DFlash's context K/V) may only record what it needs
(`record_window`) and leave the work to `sync` (`sync_in_windows`),
which the engine calls before every proposal (a no-op when the state is current). The
defaults are `update` and the identity.

Contract:
  num_draft        γ, the most draft tokens one step proposes (static). It is the one
                   draft-length knob: every drafter's config calls it `num_draft`.
  with_num_draft   the same drafter proposing `g` tokens (the verify-length controller's
                   tiers), or ValueError when it cannot.
  taps             target layers whose residual outputs `prefill_out` / `verify_out` carry.
  check_target     ValueError (one line) when the drafter does not fit the target.
  truncate_for_tiers  True for drafters that make their whole block in one pass: a
                   smaller controller tier verifies a prefix of their proposal instead of
                   rebuilding them with fewer drafts.
  samples_proposals  True when proposals at T > 0 are samples with their q (the
                   speed-of-light bound covers deterministic proposals only).
  propose_prefix   the first g tokens of `propose` (a smaller controller tier of a
                   `truncate_for_tiers` drafter); the default slices the whole proposal,
                   a drafter may skip the work of the later slots (DFlash's head).
  proposes_from_tokens  True for drafters whose proposal is a function of the committed
                   tokens alone (n-gram), with `propose_from_tokens(tokens_BL,
                   num_tokens_B) -> Proposal`: the controller then judges them in
                   retrospect at every length.
  set_verify_cost  (state, λ) -> state: the controller's marginal cost of one more
                   verified draft (DSpark's per-row verify lengths); the default ignores it.
  tree_proposer    (top_k) -> the proposer tree verification drafts with
                   (`tree_proposers.py`); the default is the chain as a degenerate tree,
                   block drafters give per-slot top-k trees.
A `Proposal` may leave slots empty (`num_proposed_B` < γ); with `q_BGV` it carries the
proposal distribution for rejection sampling (None: deterministic drafts). A draft id
outside the target's vocabulary ends the proposal at that slot.

Drafters that propose on the host (suffix trees) subclass `HostProposing`: their engine
(`host_loop.HostEngine`) gets a fresh `HostDrafter` per generation from its factory and
passes its proposals into the same jitted step. Its `propose` must be a function of the
sequences it is given, which only grow: the controller also calls it on each row's tokens
one length at a time, to judge in retrospect what its proposals would have had taken (the
prompt before the first chunk, each chunk after it).

Adding a drafter: its files plus one registration in `dspec/drafter_kinds.py` (`KINDS`),
from which the drafter registry (builders, `cfg.drafters` defaults), the checkpoint
formats, the training tasks and the slot-acceptance tables derive.
  1. One file in `dspec/decoding/drafters/`: a frozen dataclass with a `num_draft` field
     implementing this protocol (subclass `DrafterBase`, or `StatelessDrafter` when it
     keeps no per-sequence state), plus `build(cfg, target) -> (drafter, params)` reading
     `cfg.drafters.<name>`.
  2. A learned drafter also has its model (`dspec/models/`, with `checkpoint_kind`), its
     formats (`dspec/models/formats/`: a `load(path, *, target_cfg=None)`, its writers and a
     speculators form's `SPECULATORS_FIELDS`), its training task (`dspec/training/`:
     `build_task(cfg, workdir)`) and its `slot_acceptance.SlotReader`.
  3. The registration: its name, that module, its config defaults (with `num_draft`) and,
     for a learned drafter, the 'module:attr' of each part, e.g.
       DrafterKind('eagle3', 'eagle3', {'path': '', 'num_draft': 0, 'sample_proposals': True},
                   load='eagle3:load_eagle3', writers={'speculators': 'eagle3:save_speculators'},
                   tasks={'eagle3': 'eagle3_task:build_task'},
                   slots='slot_acceptance:EAGLE3_SLOTS'),
The engine, the controller, batching, the CLI, the API, the benchmark harness, training
(`training.task`) and `scripts/export_drafter.py` / `eval_drafter.py` then take it by name
(tests/test_drafter_kinds.py checks the registration); the greedy / chi-square
losslessness suites in tests/ take it as a case.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Optional, Protocol, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from dspec.decoding.state import DraftContext, Proposal
from dspec.decoding.tree_proposers import ChainTrees
from dspec.sampling import processed_probs, sample_from_probs


class Drafter(Protocol):
  num_draft: int
  taps: Tuple[int, ...]
  truncate_for_tiers: bool
  samples_proposals: bool
  proposes_from_tokens: bool

  def init(self, params, target, ctx: DraftContext, prefill_out) -> Any: ...

  def propose(self, params, state, target, ctx: DraftContext, key) -> Proposal: ...

  def update(self, params, state, target, ctx: DraftContext, verify_out, start_B,
             num_accepted_B) -> Any: ...

  def idle_update(self, params, state, target, ctx: DraftContext, verify_out, start_B,
                  num_accepted_B) -> Any: ...

  def sync(self, params, state, target, ctx: DraftContext) -> Any: ...

  def check_target(self, target_cfg) -> None: ...

  def with_num_draft(self, num_draft: int) -> 'Drafter': ...

  def set_verify_cost(self, state, verify_cost: float) -> Any: ...

  def tree_proposer(self, top_k: int) -> Any: ...


def empty_proposal(batch: int, num_draft: int) -> Proposal:
  """A proposal with no draft tokens in any row."""
  return Proposal(jnp.zeros((batch, num_draft), jnp.int32), jnp.zeros((batch,), jnp.int32))


class DrafterBase:
  """Defaults for dataclass drafters with a `num_draft` field: no taps, fits any target."""

  taps: Tuple[int, ...] = ()
  truncate_for_tiers: bool = False
  samples_proposals: bool = False
  proposes_from_tokens: bool = False

  def check_target(self, target_cfg) -> None:
    return None

  def set_verify_cost(self, state, verify_cost: float):
    return state

  def tree_proposer(self, top_k: int):
    """How tree verification (`tree_engine.py`) drafts a tree: by default the chain
    proposal as the degenerate tree."""
    del top_k
    return ChainTrees()

  def with_num_draft(self, num_draft: int):
    return dataclasses.replace(self, num_draft=num_draft)

  def idle_update(self, params, state, target, ctx, verify_out, start_B, num_accepted_B):
    return self.update(params, state, target, ctx, verify_out, start_B, num_accepted_B)

  def sync(self, params, state, target, ctx):
    return state

  def propose_prefix(self, params, state, target, ctx, key, num_draft: int) -> Proposal:
    p = self.propose(params, state, target, ctx, key)
    g = num_draft
    return Proposal(p.tokens_BG[:, :g], jnp.minimum(p.num_proposed_B, g),
                    None if p.q_BGV is None else p.q_BGV[:, :g])


def record_window(buffer_BLD, values_BGD, start_B):
  """`buffer_BLD` with each row's `values_BGD` written at positions start..start+G−1
  (positions past the end are dropped): what an idle update records for a later `sync`."""
  b, g, _ = values_BGD.shape
  positions_BG = start_B[:, None] + jnp.arange(g, dtype=jnp.int32)[None, :]
  return buffer_BLD.at[jnp.arange(b)[:, None], positions_BG].set(
      values_BGD.astype(buffer_BLD.dtype), mode='drop')


def sync_in_windows(state, ctx: DraftContext, width: int, trip, wide_width: int = 0):
  """Catches a cached drafter up: `trip(state, base_BW, committed_B)` writes the window of
  W positions from each row's `state.cache.lengths_B` (`committed_B` of them are
  committed), until every cache holds the n − 1 committed entries (no trip when current).
  W is `width` (γ+1: what one step commits); while some row is more than two such windows
  behind (after a stretch at the controller's tier 0) trips take `wide_width` positions
  at once, since the positions of one window run in parallel and trips one after another."""
  goal_B = jnp.maximum(ctx.num_tokens_B - 1, 0)

  def trips(state, w: int, behind: int):
    j = jnp.arange(w, dtype=jnp.int32)[None, :]

    def body(st):
      start_B = st.cache.lengths_B
      return trip(st, start_B[:, None] + j, jnp.clip(goal_B - start_B, 0, w))

    return jax.lax.while_loop(lambda st: jnp.any(goal_B - st.cache.lengths_B > behind),
                              body, state)

  if wide_width > 2 * width:
    state = trips(state, wide_width, 2 * width)
  return trips(state, width, 0)


class StatelessDrafter(DrafterBase):
  """Base of drafters that keep no per-sequence state."""

  def init(self, params, target, ctx, prefill_out):
    return ()

  def update(self, params, state, target, ctx, verify_out, start_B, num_accepted_B):
    return state


class HostDrafter(Protocol):
  """Proposes on the host from the committed token lists of every row."""

  num_draft: int

  def start(self, sequences: list) -> None:
    """Called once with each row's tokens so far: its prompt (the runner calls it while
    the device prefills), or its prompt and the prefill's token. `propose` then passes
    the growing sequences, from each row's first token when the loop judges the prompts
    (state built from the sequences must be built by `propose`, not here)."""

  def propose(self, sequences: list, live: np.ndarray) -> tuple:
    """Returns (tokens [B, γ] int32, num_proposed [B] int32) for the current sequences
    (each row's list only grows from call to call: the judging walks pass prefixes)."""

  def finish(self, sequences: list) -> None:
    """Called once with the final sequences (e.g. to grow a cross-request cache)."""


class HostProposing(StatelessDrafter, abc.ABC):
  """A drafter whose proposals come from a `HostDrafter` (the device side proposes none).

  `host_drafter_factory(private)` returns a callable making one fresh host drafter per
  generation. State shared across generations (e.g. a cross-request cache) is the
  process-wide one, or with `private=True` one owned by that factory alone.
  """

  @abc.abstractmethod
  def host_drafter_factory(self, private: bool = False) -> Callable[[], HostDrafter]:
    """A callable making one fresh host drafter per generation."""

  def propose(self, params, state, target, ctx, key):
    return empty_proposal(ctx.tokens_BL.shape[0], self.num_draft)


def host_drafter_factory(drafter, private: bool = False) -> Optional[Callable[[], HostDrafter]]:
  """`drafter.host_drafter_factory(private)`, or None for drafters proposing on device."""
  return drafter.host_drafter_factory(private) if isinstance(drafter, HostProposing) else None


def check_width_and_vocab(kind: str, drafter_target_cfg, target_cfg) -> None:
  """ValueError (one line) when a drafter built for one target meets another's shapes."""
  if target_cfg.embed_dim != drafter_target_cfg.embed_dim:
    raise ValueError(f'{kind} drafter width {drafter_target_cfg.embed_dim} does not match '
                     f'the target width {target_cfg.embed_dim}')
  if target_cfg.vocab_size != drafter_target_cfg.vocab_size:
    raise ValueError(f'{kind} drafter vocab {drafter_target_cfg.vocab_size} does not match '
                     f'the target vocab {target_cfg.vocab_size}')


def pick_draft(model, logits_BV, ctx: DraftContext, key, sample: bool):
  """(target token ids [B], q [B, V] over the target vocabulary or None) of one draft from
  the draft-vocabulary logits of a `DraftVocab` model: the argmax, or at T > 0 with
  `sample` a sample of the processed distribution."""
  if ctx.sampling.greedy or not sample:
    return model.token_ids(jnp.argmax(logits_BV, axis=-1)), None
  q_BV = processed_probs(logits_BV, ctx.sampling, ctx.temperature, ctx.top_p)
  return model.token_ids(sample_from_probs(key, q_BV)), model.over_target_vocab(q_BV)


def checkpoint_path(cfg, kind: str) -> str:
  """`cfg.drafters.<kind>.path`, or ValueError saying how to set and make one."""
  path = cfg.drafters[kind].path
  if not path:
    raise ValueError(f'drafter {kind} needs a trained checkpoint: set '
                     f'--config.drafters.{kind}.path=<dir> (train one: scripts/train.py '
                     f'--config=configs/{kind}_demo.py)')
  return path


def check_num_draft(kind: str, num_draft: int, low: int = 1,
                    high: Optional[int] = None) -> None:
  """ValueError naming `drafters.<kind>.num_draft` when it is outside [low, high]."""
  if num_draft < low or (high is not None and num_draft > high):
    bound = f'>= {low}' if high is None else f'in [{low}, {high}]'
    raise ValueError(f'drafters.{kind}.num_draft must be {bound}, got {num_draft}')


@dataclasses.dataclass(frozen=True)
class NoDrafter(StatelessDrafter):
  """Plain autoregressive decoding: the speculative loop with γ = 0."""

  num_draft: int = 0

  def propose(self, params, state, target, ctx, key):
    return empty_proposal(ctx.tokens_BL.shape[0], 0)

  def with_num_draft(self, num_draft: int):
    if num_draft:
      raise ValueError('the none drafter proposes nothing (num_draft 0)')
    return self


@dataclasses.dataclass(frozen=True)
class TruncatedDrafter:
  """`inner` (its state, update and taps) proposing at most `num_draft` of its tokens: a
  controller tier for drafters whose state depends on their own draft length. With
  num_draft 0 (the AR tier) it neither syncs nor updates: it `idle_update`s."""

  inner: Any
  num_draft: int
  truncate_for_tiers = True
  proposes_from_tokens = False

  @property
  def samples_proposals(self) -> bool:
    return self.inner.samples_proposals

  @property
  def taps(self) -> Tuple[int, ...]:
    return self.inner.taps

  def init(self, params, target, ctx, prefill_out):
    return self.inner.init(params, target, ctx, prefill_out)

  def propose(self, params, state, target, ctx, key):
    if self.num_draft == 0:
      return empty_proposal(ctx.tokens_BL.shape[0], 0)
    return self.inner.propose_prefix(params, state, target, ctx, key, self.num_draft)

  def update(self, params, state, target, ctx, verify_out, start_B, num_accepted_B):
    update = self.inner.update if self.num_draft else self.inner.idle_update
    return update(params, state, target, ctx, verify_out, start_B, num_accepted_B)

  def idle_update(self, params, state, target, ctx, verify_out, start_B, num_accepted_B):
    return self.inner.idle_update(params, state, target, ctx, verify_out, start_B,
                                  num_accepted_B)

  def sync(self, params, state, target, ctx):
    return self.inner.sync(params, state, target, ctx) if self.num_draft else state

  def check_target(self, target_cfg) -> None:
    return self.inner.check_target(target_cfg)

  def set_verify_cost(self, state, verify_cost: float):
    return self.inner.set_verify_cost(state, verify_cost)

  def with_num_draft(self, num_draft: int):
    return dataclasses.replace(self, num_draft=num_draft)

