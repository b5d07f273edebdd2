"""The MTP drafter: catch-up over committed positions, then D chained draft steps.

Cache layout (one `KVCache` layer per draft depth, positions aligned 1:1 with the target).
With n committed tokens t_0..t_{n-1}, the target hidden h^0_p is known for p <= n-2, and
depth k's entry at position p reads t_{p+k}, so only p <= c_k = n-1-k can use committed
tokens alone. The persistent cache of depth k holds exactly those positions (depth 1 holds
n-1 entries, depth k lags k-1 positions behind), and `carry` keeps each depth's raw block
output x^k at its frontier c_k.

  update   catch-up: after a verify at start..start+γ that committed m tokens, depth k
           runs over the static window p = start-k+1+j (j = 0..γ) with tokens
           t_{start+1+j} (the same for every depth), hidden input = carry_{k-1} then depth
           k-1's window outputs shifted by one; slots j < m (and p >= 0) are written.
  init     prefill is the same catch-up from start 0 over the prompt window 0..P-2.
  idle     at the controller's AR tier the update only records the target hidden h^0 of
           the verify window (`h0_BLD`); `sync`, before the next proposal, catches every
           depth up over the recorded positions in windows of γ+1 (a loop of zero trips
           when current), so a stretch of AR steps costs no MTP pass until drafting resumes.
           `update` is record + sync.
  propose  d_1 = head(depth 1 at n-2) from carry_1. Depth k >= 2 needs its entries at
           n-k..n-2, which read the drafts d_1..d_{k-1}: it runs over those k-1 positions
           (hidden = carry_{k-1} then depth k-1's draft outputs) attending to its committed
           cache plus themselves, and its last position gives d_k. These draft entries are
           scratch (never written to the cache).
  tree     (`grow_tree`, tree verification) the same passes per node of EAGLE-2's beam:
           a depth's W beam paths run side by side, each attending only to itself.

So every draft token is exactly what the full-sequence training pass (`MTP.__call__`) gives
at position n-2 on the committed tokens followed by the earlier drafts: training and
inference see the same causal context at every depth. Rollback = lengths/frontiers follow
the committed count; nothing is copied. The parallel variant has no lag (head k reads h^0
only): its depths share depth 1's window and each drafts from its own carry.

With a reduced draft vocabulary (trained, or a full-vocabulary MTP restricted at load time
by `drafters.mtp.token_map`) each depth scores only `draft_vocab`; drafts are mapped
back to target ids, and at T > 0 a sampled draft's q is placed into the full vocabulary
(zero outside the subset), so rejection sampling stays exact.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx, struct

from dspec.decoding.drafter import (DrafterBase, check_num_draft, check_width_and_vocab,
                                    checkpoint_path, pick_draft, record_window,
                                    sync_in_windows)
from dspec.decoding import tree_proposers
from dspec.decoding.state import Proposal
from dspec.models.config import TransformerConfig
from dspec.models.draft_vocab import read_token_map
from dspec.models.formats.mtp import load_mtp
from dspec.models.kv_cache import KVCache
from dspec.models.mtp import MTP, MTPConfig


@struct.dataclass
class MTPState:
  """cache: one layer per draft depth (lengths_B: depth-1 entries, n - 1 once synced).
  carry_GBD: raw block output of depth k at its frontier lengths_B - k (parallel: - 1).
  h0_BLD: depth 1's hidden input h^0 at every position the target has verified.
  """

  cache: KVCache
  carry_GBD: jnp.ndarray
  h0_BLD: jnp.ndarray

  LOGICAL_AXES: ClassVar[dict] = {'carry_GBD': (None, 'batch', None),
                                  'h0_BLD': ('batch', None, None)}


@dataclasses.dataclass(frozen=True)
class MTPDrafter(DrafterBase):
  """MTP drafting with `num_draft` depths (<= trained D, or any count with shared_depth).

  sample_proposals: at T > 0, sample each draft from the processed depth distribution
  and pass q to rejection sampling; otherwise argmax drafts (one-hot q).
  """

  graphdef: Any
  config: MTPConfig
  target_cfg: TransformerConfig
  num_draft: int
  sample_proposals: bool = False
  catch_up_width: int = 32    # positions per catch-up trip after tier-0 stretches

  @property
  def samples_proposals(self) -> bool:
    return self.sample_proposals

  def __post_init__(self):
    check_num_draft('mtp', self.num_draft)
    if self.num_draft > self.config.num_depths and not self.config.shared_depth:
      raise ValueError(f'drafters.mtp.num_draft={self.num_draft} exceeds the '
                       f'{self.config.num_depths} trained depths (only a shared_depth MTP '
                       'can recurse further)')

  @classmethod
  def from_model(cls, mtp: MTP, num_draft: int = 0, sample_proposals: bool = False):
    """(drafter, params) for an MTP module; num_draft=0 drafts with every trained depth."""
    graphdef, params = nnx.split(mtp)
    drafter = cls(graphdef, mtp.cfg, mtp.target_cfg, num_draft or mtp.cfg.num_depths,
                  sample_proposals)
    return drafter, params

  @property
  def taps(self):
    return self.config.taps(self.target_cfg)

  def check_target(self, target_cfg):
    want = self.target_cfg
    check_width_and_vocab('mtp', want, target_cfg)
    if self.taps and target_cfg.num_layers != want.num_layers:
      raise ValueError(f'mtp drafter taps layer {want.num_layers - 1} (pre_norm h0 of a '
                       f'{want.num_layers}-layer target) but the target has '
                       f'{target_cfg.num_layers} layers')

  # ------------------------------------------------------------------ internals

  def _lag(self, k: int) -> int:
    return k - 1 if self.config.chained else 0

  def _cached_pass(self, mtp, target, k, cache, h_in_BWD, tokens_BW, positions_BW,
                   valid_BW):
    """Depth k over a window: writes valid slots into the cache, attends to the cache."""
    write_BW = jnp.where(valid_BW, positions_BW, cache.max_len)
    mask_BWS = jnp.arange(cache.max_len)[None, None, :] <= positions_BW[:, :, None]

    def kv_fn(k_new, v_new):
      nonlocal cache
      cache = cache.write(k - 1, k_new, v_new, write_BW)
      return cache.k_LBSKD[k - 1], cache.v_LBSKD[k - 1], mask_BWS

    x = mtp.block(target, k, h_in_BWD, tokens_BW, positions_BW, kv_fn)
    return x, cache

  def _catch_up(self, mtp, target, cache, carry_GBD, h0_BWD, tokens_BW, base_BW,
                num_valid_B):
    """Runs every depth over one window; returns (cache, new carries).

    Depth k's slot j sits at position base_BW[:, j] - lag(k) and is valid for
    j < num_valid_B (and position >= 0); its hidden input is h0 (depth 1 / parallel) or
    depth k-1's output one slot earlier (slot 0: depth k-1's old carry).
    """
    b, w = tokens_BW.shape
    rows = jnp.arange(b)
    j = jnp.arange(w)[None, :]
    last_B = num_valid_B - 1
    carries, x_prev = [], None
    for k in range(1, self.num_draft + 1):
      positions_BW = base_BW - self._lag(k)
      valid_BW = (j < num_valid_B[:, None]) & (positions_BW >= 0)
      if k == 1 or not self.config.chained:
        h_in = h0_BWD
      else:
        raw = jnp.concatenate([carry_GBD[k - 2][:, None], x_prev[:, :-1]], axis=1)
        h_in = mtp.chain(target, k - 1, raw)
      x, cache = self._cached_pass(mtp, target, k, cache, h_in, tokens_BW, positions_BW,
                                   valid_BW)
      last_ok_B = valid_BW[rows, jnp.maximum(last_B, 0)] & (last_B >= 0)
      carries.append(jnp.where(last_ok_B[:, None], x[rows, jnp.maximum(last_B, 0)],
                               carry_GBD[k - 1].astype(x.dtype)))
      x_prev = x
    return cache, jnp.stack(carries)

  # ------------------------------------------------------------------ protocol

  def init(self, params, target, ctx, prefill_out):
    """Prefill = a catch-up from start 0 over the prompt window (positions 0..W-1)."""
    mtp = nnx.merge(self.graphdef, params)
    b, length = ctx.tokens_BL.shape
    t = self.target_cfg
    cache = KVCache.for_model(t, self.num_draft, b, length)
    h0_BWD = mtp.h0(prefill_out)
    w = h0_BWD.shape[1]
    j_BW = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
    carry = jnp.zeros((self.num_draft, b, t.embed_dim), h0_BWD.dtype)
    valid_B = jnp.maximum(ctx.num_tokens_B - 1, 0)
    cache, carry = self._catch_up(mtp, target, cache, carry, h0_BWD,
                                  ctx.tokens_BL[:, 1:w + 1], j_BW, valid_B)
    h0_BLD = jnp.zeros((b, length, t.embed_dim), h0_BWD.dtype)
    h0_BLD = h0_BLD.at[:, :w].set(h0_BWD[:, :length])
    return MTPState(cache.with_lengths(valid_B), carry, h0_BLD)

  def idle_update(self, params, state, target, ctx, verify_out, start_B, num_accepted_B):
    """Records h^0 of the verify window (positions start..start+γ) for a later `sync`."""
    del ctx, num_accepted_B
    h0_BGD = nnx.merge(self.graphdef, params).h0(verify_out)
    return state.replace(h0_BLD=record_window(state.h0_BLD, h0_BGD, start_B))

  def update(self, params, state, target, ctx, verify_out, start_B, num_accepted_B):
    """Record, then catch up over the committed positions (the committed count comes from
    ctx: num_accepted_B + 1 for live rows, less when a stop token or the budget cut it)."""
    state = self.idle_update(params, state, target, ctx, verify_out, start_B, num_accepted_B)
    return self.sync(params, state, target, ctx)

  def sync(self, params, state, target, ctx):
    """Catch-up, γ+1 positions per trip, until depth 1 holds the n - 1 committed entries."""
    mtp = nnx.merge(self.graphdef, params)
    b, length = ctx.tokens_BL.shape
    rows = jnp.arange(b)[:, None]

    def trip(st, base_BW, committed_B):
      h0_BWD = st.h0_BLD[rows, jnp.minimum(base_BW, length - 1)]
      tokens_BW = ctx.tokens_BL[rows, jnp.minimum(base_BW + 1, length - 1)]
      cache, carry = self._catch_up(mtp, target, st.cache, st.carry_GBD, h0_BWD, tokens_BW,
                                    base_BW, committed_B)
      return st.replace(cache=cache.with_lengths(st.cache.lengths_B + committed_B),
                        carry_GBD=carry)

    return sync_in_windows(state, ctx, self.num_draft + 1, trip, self.catch_up_width)

  def draft(self, params, state, target, ctx, key):
    """(draft tokens [B, G], depth logits at position n-2 over the draft vocabulary
    [B, G, V'], q [B, G, V] or None)."""
    mtp = nnx.merge(self.graphdef, params)
    n_B = ctx.num_tokens_B
    carry = state.carry_GBD
    cache = state.cache
    logits, tokens, qs = [], [], []
    x_prev = None
    for k in range(1, self.num_draft + 1):
      if k == 1 or not self.config.chained:
        x_last_BD = carry[k - 1]
      else:
        x = self._draft_pass(mtp, target, k, cache, carry[k - 2],
                             None if x_prev is None else x_prev[:, None],
                             jnp.stack(tokens, axis=1)[:, None], n_B)[:, 0]
        x_last_BD, x_prev = x[:, -1], x
      logits_BV = mtp.logits(target, k, mtp.final(target, k, x_last_BD[:, None]))[:, 0]
      token_B, q_BV = pick_draft(mtp, logits_BV, ctx, jax.random.fold_in(key, k),
                                 self.sample_proposals)
      logits.append(logits_BV)
      tokens.append(token_B)
      qs.append(q_BV)
    q_BGV = None if qs[0] is None else jnp.stack(qs, axis=1)
    return jnp.stack(tokens, axis=1), jnp.stack(logits, axis=1), q_BGV

  def _draft_pass(self, mtp, target, k, cache, carry_prev_BD, x_prev_BWJD, drafts_BWJ,
                  n_B):
    """Depth k >= 2 over positions n-k..n-2 of W paths side by side (path w reading its
    drafts d_1..d_{k-1}, hidden: carry_{k-1} then its `x_prev_BWJD`, depth k-1's outputs),
    each attending to the committed cache (positions < n-k) plus its own path causally;
    nothing is written. Returns x [B, W, k-1, D]."""
    b, nw, w = drafts_BWJ.shape
    j = jnp.tile(jnp.arange(w, dtype=jnp.int32), nw)
    path = jnp.repeat(jnp.arange(nw), w)
    positions_BT = n_B[:, None] - k + j[None, :]
    valid_BT = positions_BT >= 0
    raw = jnp.broadcast_to(carry_prev_BD[:, None, None], (b, nw, 1, carry_prev_BD.shape[-1]))
    if x_prev_BWJD is not None:
      raw = jnp.concatenate([raw, x_prev_BWJD.astype(raw.dtype)], axis=2)
    h_in = mtp.chain(target, k - 1, raw.reshape(b, nw * w, -1))
    cached_BTS = jnp.broadcast_to(
        jnp.arange(cache.max_len)[None, None, :] < (n_B - k)[:, None, None],
        (b, nw * w, cache.max_len))
    own_TT = (path[None, :] == path[:, None]) & (j[None, :] <= j[:, None])
    own_BTT = own_TT[None] & valid_BT[:, None, :]
    mask_BTS = jnp.concatenate([cached_BTS, own_BTT], axis=-1)

    def kv_fn(k_new, v_new):
      k_all = jnp.concatenate([cache.k_LBSKD[k - 1], k_new.astype(cache.k_LBSKD.dtype)], 1)
      v_all = jnp.concatenate([cache.v_LBSKD[k - 1], v_new.astype(cache.v_LBSKD.dtype)], 1)
      return k_all, v_all, mask_BTS

    x = mtp.block(target, k, h_in, drafts_BWJ.reshape(b, nw * w), positions_BT, kv_fn)
    return x.reshape(b, nw, w, -1)

  def propose(self, params, state, target, ctx, key) -> Proposal:
    tokens_BG, _, q_BGV = self.draft(params, state, target, ctx, key)
    # d_1 reads depth 1 at position n-2: nothing to propose before two tokens exist.
    num_B = jnp.where(ctx.num_tokens_B >= 2, self.num_draft, 0).astype(jnp.int32)
    return Proposal(tokens_BG, num_B, q_BGV)

  def tree_proposer(self, top_k: int):
    """EAGLE-2's dynamic trees (`grow_tree`)."""
    return tree_proposers.BeamTrees(top_k)

  def grow_tree(self, params, state, target, ctx, grower, depth: int):
    """Expands `grower` through `depth` depths, the draft run per beam node: the root's
    children come from depth 1's carry; a depth-(k-1) beam node's from depth k at n-2,
    chained: over its path's k-1 positions (hidden: carry_{k-1}, then depth k-1's outputs
    along its parent's path), the W beam paths side by side in one `_draft_pass`;
    parallel: depth k's carry, the same children under every node of a depth."""
    mtp = nnx.merge(self.graphdef, params)
    carry = state.carry_GBD
    b = ctx.num_tokens_B.shape[0]
    rows = jnp.arange(b)[:, None]
    logits = lambda k, x_BWD: mtp.logits(target, k, mtp.final(target, k, x_BWD))
    parent_BW, tokens_BW = grower.expand(logits(1, carry[0][:, None]), mtp.token_ids)
    paths_BWJ, x_prev_BWJD = tokens_BW[:, :, None], None
    for k in range(2, depth + 1):
      w = tokens_BW.shape[1]
      if self.config.chained:
        x_prev_BWJD = self._draft_pass(
            mtp, target, k, state.cache, carry[k - 2],
            None if x_prev_BWJD is None else x_prev_BWJD[rows, parent_BW], paths_BWJ,
            ctx.num_tokens_B)
        x_BWD = x_prev_BWJD[:, :, -1]
      else:
        x_BWD = jnp.broadcast_to(carry[k - 1][:, None], (b, w, carry.shape[-1]))
      parent_BW, tokens_BW = grower.expand(logits(k, x_BWD), mtp.token_ids)
      paths_BWJ = jnp.concatenate([paths_BWJ[rows, parent_BW], tokens_BW[:, :, None]],
                                  axis=2)


def build(cfg, target):
  """(MTPDrafter, params) from `cfg.drafters.mtp` (a dspec checkpoint, a speculators `mtp`
  directory or a HF checkpoint with DeepSeek-V3-layout MTP layers); num_draft 0: every
  trained depth. A `token_map` file restricts a full-vocabulary MTP's drafts to its
  token ids (FastMTP's vocabulary compression at inference)."""
  c = cfg.drafters.mtp
  path = checkpoint_path(cfg, 'mtp')
  mtp = load_mtp(path, target_cfg=target.cfg)
  if c.token_map:
    if mtp.cfg.draft_vocab:
      raise ValueError(f'drafters.mtp.token_map restricts a full-vocabulary MTP, but {path} '
                       f'already drafts from {len(mtp.cfg.draft_vocab)} tokens')
    mtp.cfg = dataclasses.replace(
        mtp.cfg, draft_vocab=read_token_map(c.token_map, target.cfg.vocab_size))
  return MTPDrafter.from_model(mtp, c.num_draft, c.sample_proposals)
