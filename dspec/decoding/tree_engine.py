"""Tree verification in the decoding loop: one target pass over a `DraftTree` per step.

`TreeEngine` wraps a `SpeculativeEngine` (same prefill, decode state and drafter state)
and a tree proposer (`tree_proposers.py`) that turns the engine's drafter into a tree of
at most `num_nodes` nodes. A step:

  1. the proposer drafts a tree; node 0 is set to the anchor; a token outside the
     vocabulary cuts its subtree, and nodes whose cache slot lies past the buffer are
     dropped (near the end of the budget);
  2. one target forward over every node: positions start + depth, K/V written to slots
     start + node, each node attending to the prefix, its ancestors and itself;
  3. `verify_tree` (greedy longest match, or lossless multi-candidate sampling);
  4. the accepted path's K/V moved to slots start + 0..n (`compact_path`);
  5. commit as the chain engine does (cut at the first stop token and at the budget);
  6. the drafter's `update` sees the target output gathered along the accepted path, i.e.
     exactly what a chain verify of that path would have given it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from dspec.compiled_programs import ProgramCache
from dspec.config_checks import check_int
from dspec.decoding.engine import (NO_STEP_LIMIT, SpeculativeEngine, device_scalar,
                                   jit_program, mask_logits, run_steps)
from dspec.decoding.state import DecodeState, TreeTrace
from dspec.decoding.tree import DraftTree, compact_path
from dspec.decoding.tree_verification import verify_tree
from dspec.errors import UserError


# The most nodes a tree may have: one verify pass scores them all at once, with a
# [B, N, cache] attention mask and N cache slots past every row's tokens.
MAX_TREE_NODES = 1024


@dataclasses.dataclass(frozen=True)
class TreeConfig:
  """Tree verification's knobs (`--config.tree.*`): nodes per tree (anchor included) and
  candidates per slot of a block drafter's tree, at most num_nodes (no node of the tree
  has room for more children, and a larger top_k only grows the proposers' buffers)."""

  num_nodes: int = 32
  top_k: int = 8

  def __post_init__(self):
    object.__setattr__(self, 'num_nodes',
                       check_int(self.num_nodes, 'tree.num_nodes', 2, MAX_TREE_NODES))
    object.__setattr__(self, 'top_k', check_int(self.top_k, 'tree.top_k', 1))
    if self.top_k > self.num_nodes:
      raise UserError(f'tree.top_k={self.top_k} must be <= tree.num_nodes={self.num_nodes} '
                      '(no node of such a tree has room for more candidates)')

  @classmethod
  def from_config(cls, section) -> 'TreeConfig':
    """From a config's `tree` section (a mapping of these fields)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(section) - fields)
    if unknown:
      raise UserError(f'tree: unknown knobs {unknown} (known: {sorted(fields)})')
    return cls(**dict(section))


def fit_tree(tree: DraftTree, anchor_B, vocab_size: int, room_B) -> DraftTree:
  """The tree with the anchor at node 0, out-of-vocabulary nodes orphaned (never accepted,
  their subtrees unreachable) and at most `room_B` nodes (cache slots left)."""
  n = jnp.arange(tree.num_nodes)[None, :]
  in_vocab = (tree.tokens_BN >= 0) & (tree.tokens_BN < vocab_size)
  return tree.replace(
      tokens_BN=jnp.where(in_vocab, tree.tokens_BN, 0).at[:, 0].set(anchor_B),
      parents_BN=jnp.where(in_vocab & (n > 0), tree.parents_BN, -1),
      num_nodes_B=jnp.clip(jnp.minimum(tree.num_nodes_B, room_B), 1, tree.num_nodes))


def tree_forward(target, tree: DraftTree, cache, taps):
  """The target over every node of `tree` on top of `cache` (lengths = the start)."""
  start_B = cache.lengths_B
  return target(tree.tokens_BN, cache=cache, positions_BT=tree.positions_BN(start_B),
                slots_BT=tree.slots_BN(start_B),
                mask_BTS=tree.attention_mask_BNS(start_B, cache.max_len), taps=taps)


@dataclasses.dataclass(frozen=True)
class TreeEngine:
  """Tree-verifying decoding program (hashable; keys its compiled programs).

  engine: the chain engine (target, drafter, sampling, stop ids, placement). proposer: its
  `propose_tree(drafter, params, state, target, ctx, key, num_nodes) -> DraftTree`.
  max_depth: the deepest node verified (a step commits at most max_depth + 1 tokens).
  trace: record row 0's tree and accepted path per step (`DecodeState.trace`).
  """

  engine: SpeculativeEngine
  proposer: Any
  num_nodes: int
  max_depth: int
  trace: bool = False

  def __post_init__(self):
    if self.num_nodes < 1 or not 0 <= self.max_depth < self.num_nodes:
      raise ValueError(f'TreeEngine needs num_nodes >= 1 and 0 <= max_depth < num_nodes, '
                       f'got num_nodes={self.num_nodes}, max_depth={self.max_depth}')

  # The engine protocol's face (as a fixed-verification `SpeculativeEngine`).
  adaptive = False
  row0_tiers = None

  def tier_steps(self) -> dict:
    return {}

  @property
  def sampling(self):
    return self.engine.sampling

  @property
  def placement(self):
    """The chain engine's: the tree's programs run on the mesh its prefill places on."""
    return self.engine.placement

  @property
  def drafter(self):
    return self.engine.drafter

  @property
  def num_draft(self) -> int:
    return self.engine.num_draft

  def _draft(self, target, drafter_params, state: DecodeState, key_draft) -> tuple:
    """(synced drafter state, the step's tree: anchor at node 0, fitted to the buffer)."""
    eng = self.engine
    ctx = eng.context(state)
    dstate = eng.drafter.sync(drafter_params, state.drafter_state, target, ctx)
    tree = self.proposer.propose_tree(eng.drafter, drafter_params, dstate, target, ctx,
                                      key_draft, self.num_nodes)
    rows = jnp.arange(state.tokens_BL.shape[0])
    tree = fit_tree(tree, state.tokens_BL[rows, state.num_tokens_B - 1],
                    target.cfg.vocab_size, state.cache.max_len - state.cache.lengths_B)
    return dstate, tree

  def _keys(self, state: DecodeState):
    """(draft key, verify key) of the state's step."""
    return jax.random.split(jax.random.fold_in(state.key, state.step))

  def propose_fn(self, target_params, drafter_params, state: DecodeState):
    """The first half of `step_fn`: (state with the drafter synced, its tree), for a host
    that masks the tree's nodes before `step_fn(..., synced=True)` verifies it."""
    target = nnx.merge(self.engine.target_graphdef, target_params)
    dstate, tree = self._draft(target, drafter_params, state, self._keys(state)[0])
    return state.replace(drafter_state=dstate), tree

  def step_fn(self, target_params, drafter_params, state: DecodeState,
              tree: Optional[DraftTree] = None, allowed_BNW=None, *,
              synced: bool = False) -> DecodeState:
    """One draft → verify → accept → commit step. Structured output passes the tree
    `propose_fn` drafted (`synced`) and `allowed_BNW`, each node's allowed next tokens
    (packed bitmasks): the verify scores every node against the masked target."""
    eng = self.engine
    target = nnx.merge(eng.target_graphdef, target_params)
    b = state.tokens_BL.shape[0]
    rows = jnp.arange(b)
    key_draft, key_verify = self._keys(state)
    if synced:
      dstate = state.drafter_state
    else:
      dstate, tree = self._draft(target, drafter_params, state, key_draft)
    start_B = state.cache.lengths_B
    out = tree_forward(target, tree, state.cache, eng.drafter.taps)
    logits_BNV = out.logits_BTV if allowed_BNW is None else mask_logits(out.logits_BTV,
                                                                        allowed_BNW)
    n_B, path_BD1, emitted_BD1 = verify_tree(key_verify, tree, logits_BNV, eng.sampling,
                                             state.temperature, state.top_p, self.max_depth)
    along = lambda x: x[rows[:, None], path_BD1]
    path_out = out._replace(logits_BTV=None, hidden_BTD=along(out.hidden_BTD),
                            taps_BTND=along(out.taps_BTND),
                            cache=compact_path(out.cache, start_B, path_BD1))

    # Commit, as `SpeculativeEngine.step_fn`: cut at the first stop token and the budget.
    remaining_B = state.max_new_tokens - state.generated_B()
    live_B = ~state.done_B
    j = jnp.arange(self.max_depth + 1)[None, :]
    is_stop = jnp.zeros_like(emitted_BD1, bool)
    for sid in eng.stop_ids:
      is_stop |= emitted_BD1 == sid
    is_stop &= j <= n_B[:, None]
    first_stop_B = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1),
                             self.max_depth + 1)
    count_B = jnp.minimum(jnp.minimum(n_B + 1, first_stop_B + 1), remaining_B)
    count_B = jnp.where(live_B, count_B, 0)
    pos_BD1 = jnp.where(j < count_B[:, None], state.num_tokens_B[:, None] + j,
                        state.tokens_BL.shape[1])
    tokens_BL = state.tokens_BL.at[rows[:, None], pos_BD1].set(emitted_BD1, mode='drop')
    num_tokens_B = state.num_tokens_B + count_B
    done_B = state.done_B | (first_stop_B < count_B) | (
        num_tokens_B - state.prompt_len_B >= state.max_new_tokens)
    cache = path_out.cache.with_lengths(jnp.where(live_B, start_B + n_B + 1, start_B))
    live = live_B.astype(jnp.int32)
    s = state.stats
    accepted_B = jnp.minimum(n_B, count_B)   # a stop token cuts accepted drafts too
    # Per depth k (column k - 1): reached when the accepted path got to depth k - 1 and
    # its node there had a child to verify; passed when depth k was accepted too.
    g = s.reached_BG.shape[1]
    has_child_BN = jnp.zeros(tree.tokens_BN.shape, bool).at[
        rows[:, None], jnp.where(tree.valid_BN(), tree.parents_BN, tree.num_nodes)].set(
            True, mode='drop')
    k_BG = jnp.arange(1, g + 1)[None, :]
    path_BG = path_BD1[:, :g] if path_BD1.shape[1] >= g else jnp.pad(
        path_BD1, ((0, 0), (0, g - path_BD1.shape[1])))
    reached_BG = live_B[:, None] & (k_BG <= n_B[:, None] + 1) & (
        k_BG <= path_BD1.shape[1]) & has_child_BN[rows[:, None], path_BG]
    passed_BG = reached_BG & (k_BG <= n_B[:, None])
    stats = s.replace(
        steps_B=s.steps_B + live, committed_B=s.committed_B + count_B,
        proposed_B=s.proposed_B + live * (tree.num_nodes_B - 1),
        accepted_B=s.accepted_B + live * accepted_B,
        accept_hist_BG1=s.accept_hist_BG1 + live[:, None] * (
            jnp.arange(g + 1)[None, :] == jnp.minimum(accepted_B, g)[:, None]),
        reached_BG=s.reached_BG + reached_BG, passed_BG=s.passed_BG + passed_BG,
        row0_committed_S=s.row0_committed_S.at[s.steps_B[0]].set(count_B[0], mode='drop'))
    new_state = state.replace(tokens_BL=tokens_BL, num_tokens_B=num_tokens_B, done_B=done_B,
                              cache=cache, step=state.step + 1, stats=stats,
                              trace=self._traced(state, tree, path_BD1, accepted_B))
    dstate = eng.drafter.update(drafter_params, dstate, target, eng.context(new_state),
                                path_out._replace(cache=cache), start_B, n_B)
    return new_state.replace(drafter_state=dstate)

  def _traced(self, state: DecodeState, tree: DraftTree, path_BD1, accepted_B):
    """`state.trace` with row 0's step written at its step index (a done row: none)."""
    t = state.trace
    if t is None:
      return None
    at = jnp.where(state.done_B[0], t.num_nodes_S.shape[0], state.stats.steps_B[0])
    put = lambda buf, value: buf.at[at].set(value, mode='drop')
    put_row = lambda buf, row: buf.at[at, :row.shape[0]].set(row, mode='drop')  # a smaller tree
    return TreeTrace(put_row(t.tokens_SN, tree.tokens_BN[0]),
                     put_row(t.parents_SN, tree.parents_BN[0]),
                     put(t.num_nodes_S, tree.num_nodes_B[0]), put_row(t.path_SD1, path_BD1[0]),
                     put(t.num_accepted_S, accepted_B[0]))

  def run_fn(self, target_params, drafter_params, state: DecodeState, max_steps,
             force_wide=False, *, until_row_done: bool = False) -> DecodeState:
    """As `SpeculativeEngine.run_fn` (`force_wide` changes nothing: every step verifies
    all of its tree's nodes)."""
    del force_wide
    return run_steps(lambda st: self.step_fn(target_params, drafter_params, st), state,
                     max_steps, until_row_done)

  @property
  def prefill_fn(self):
    """The chain engine's prefill (a tree step starts from the same state)."""
    return self.engine.prefill_fn

  def buffer_len(self, prompt_len: int, max_new_tokens: int) -> int:
    return self.engine.buffer_len(prompt_len, max_new_tokens)

  def prefill(self, target_params, drafter_params, prompt_BP, prompt_len_B, **kw):
    state = self.engine.prefill(target_params, drafter_params, prompt_BP, prompt_len_B, **kw)
    if not self.trace:
      return state
    max_steps = state.stats.row0_committed_S.shape[0]
    programs = _programs(self, state.tokens_BL.shape)
    return state.replace(trace=programs['trace_zeros'](max_steps, self.num_nodes,
                                                       self.max_depth))

  def run(self, target_params, drafter_params, state, max_steps=None,
          force_wide: bool = False, *, until_row_done: bool = False) -> DecodeState:
    """Up to `max_steps` steps (None: to the end; `until_row_done`: also until a live row
    finishes). `force_wide` (the controller's profile) changes nothing."""
    del force_wide
    limit = device_scalar(NO_STEP_LIMIT if max_steps is None else int(max_steps),
                          placement=self.placement)
    name = 'run_until_row_done' if until_row_done else 'run'
    return _programs(self, state.tokens_BL.shape)[name](target_params, drafter_params,
                                                        state, limit)

  def generate(self, target_params, drafter_params, state) -> DecodeState:
    return self.run(target_params, drafter_params, state)

  def warm_marks(self, tokens_shape) -> set:
    """See `SpeculativeEngine.warm_marks`."""
    return _programs(self, tokens_shape).setdefault('warm', set())

  def propose(self, target_params, drafter_params, state):
    """`propose_fn` jitted (the state is donated)."""
    return _programs(self, state.tokens_BL.shape)['propose'](target_params, drafter_params,
                                                             state)

  def masked_step(self, target_params, drafter_params, state, tree: DraftTree,
                  allowed_BNW) -> DecodeState:
    """`step_fn` jitted on `propose`'s state and tree, each node's logits masked by
    `allowed_BNW` (the state is donated)."""
    return _programs(self, state.tokens_BL.shape)['step_synced'](
        target_params, drafter_params, state, tree, allowed_BNW)


@ProgramCache
def _programs(engine: TreeEngine) -> dict:
  """The engine's jitted programs; one set per (batch, buffer) shape of its states (the
  trace's zeros on one device: trees on a mesh record no trace)."""
  jit = functools.partial(jit_program, engine)
  return {'run': jit(engine.run_fn, donate_argnums=2),
          'run_until_row_done': jit(functools.partial(engine.run_fn, until_row_done=True),
                                    donate_argnums=2),
          'propose': jit(engine.propose_fn, donate_argnums=2),
          'step_synced': jit(functools.partial(engine.step_fn, synced=True),
                             donate_argnums=2),
          'trace_zeros': jax.jit(TreeTrace.zeros, static_argnums=(0, 1, 2))}
