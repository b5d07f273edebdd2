"""The EAGLE-3 drafter: catch-up over committed positions, then a chain of γ draft steps.

With n committed tokens t_0..t_{n-1} the target's taps are known at p <= n-2, and draft
entry p reads (fused taps at p, t_{p+1}), so the committed entries are p = 0..n-2. The
draft cache (one `KVCache` layer per draft layer, aligned 1:1 with target positions) holds
exactly those, and `carry` keeps the raw output x of entry n-2.

  init     the prompt's taps at 0..P-1 with tokens t_1..t_P: entries 0..n-2 (P = n-1).
  update   after a verify at start..start+γ that committed m tokens, entries
           p = start+j (j = 0..γ) read the fused verify taps at j and t_{start+1+j}; slots
           j < m are written (the rest run but are dropped), carry = x at slot m-1.
  idle     at the controller's AR tier the update only records the fused taps (`g_BLD`);
           `sync`, before the next proposal, writes the recorded entries γ+1 per loop trip
           (zero trips when current). `update` is record + sync.
  propose  d_1 = head(carry). Entry n-3+k (k >= 2) reads next_hidden(previous entry's x)
           and d_{k-1}, attends to the committed cache plus the chain so far (scratch K/V,
           never written), and gives d_k.
  tree     (`grow_tree`, tree verification) the same steps per node of EAGLE-2's beam: a
           depth's W beam nodes run as W entries, each seeing only its ancestors' entries.

So every draft equals the training-time-test step over the committed tokens followed by
the earlier drafts (`Eagle3Model.ttt_logits`). At T > 0 with `sample_proposals`, each draft
is sampled from the processed draft-vocabulary distribution and its q (placed into the
target vocabulary) goes to rejection sampling, which keeps the output exact.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Tuple

import jax
import jax.numpy as jnp
from flax import nnx, struct

from dspec.decoding.drafter import (DrafterBase, check_num_draft, check_width_and_vocab,
                                    checkpoint_path, pick_draft, record_window,
                                    sync_in_windows)
from dspec.decoding import tree_proposers
from dspec.decoding.state import Proposal
from dspec.models.config import TransformerConfig
from dspec.models.eagle3 import Eagle3Config, Eagle3Model
from dspec.models.formats.eagle3 import load_eagle3
from dspec.models.kv_cache import KVCache


@struct.dataclass
class Eagle3State:
  """cache: entries 0..lengths_B-1 (n - 1 once synced); carry_BD: raw x of the last one;
  g_BLD: the fused taps at every position the target has verified."""

  cache: KVCache
  carry_BD: jnp.ndarray
  g_BLD: jnp.ndarray

  LOGICAL_AXES: ClassVar[dict] = {'carry_BD': ('batch', None), 'g_BLD': ('batch', None, None)}


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(DrafterBase):
  """EAGLE-3 chain drafting of `num_draft` tokens (any length: the chain recurses)."""

  graphdef: Any
  config: Eagle3Config
  target_cfg: TransformerConfig
  num_draft: int
  sample_proposals: bool = True
  catch_up_width: int = 32    # positions per catch-up trip after tier-0 stretches

  def __post_init__(self):
    check_num_draft('eagle3', self.num_draft)

  @property
  def samples_proposals(self) -> bool:
    return self.sample_proposals

  @classmethod
  def create(cls, model: Eagle3Model, num_draft: int = 0,
             sample_proposals: bool = True) -> Tuple['Eagle3Drafter', Any]:
    """(drafter, params); num_draft 0 drafts the trained ttt_steps."""
    graphdef, params = nnx.split(model)
    return cls(graphdef, model.cfg, model.target_cfg, num_draft or model.cfg.ttt_steps,
               sample_proposals), params

  @property
  def taps(self) -> Tuple[int, ...]:
    return self.config.target_layer_ids

  def check_target(self, target_cfg) -> None:
    mine = self.target_cfg
    check_width_and_vocab('eagle3', mine, target_cfg)
    if target_cfg.num_layers != mine.num_layers:
      raise ValueError(f'eagle3 drafter taps layers {list(self.taps)} of a '
                       f'{mine.num_layers}-layer target, but the target has '
                       f'{target_cfg.num_layers} layers')

  # ------------------------------------------------------------------ internals

  def _cached_pass(self, model, target, cache, g_BWD, tokens_BW, positions_BW, valid_BW):
    """Entries over a window: valid slots are written, every slot attends to the cache
    at positions <= its own."""
    write_BW = jnp.where(valid_BW, positions_BW, cache.max_len)
    slots_S = jnp.arange(cache.max_len)[None, None, :]
    mask_BWS = slots_S <= positions_BW[:, :, None]

    def kv_fn_of(i):
      def kv_fn(k_new, v_new):
        nonlocal cache
        cache = cache.write(i, k_new, v_new, write_BW)
        window_BWS = self.config.window_mask(i, positions_BW[:, :, None], slots_S)
        return cache.k_LBSKD[i], cache.v_LBSKD[i], mask_BWS & window_BWS
      return kv_fn

    x = model.block(target, g_BWD, tokens_BW, positions_BW, kv_fn_of)
    return x, cache

  def _catch_up(self, model, target, state, g_BWD, tokens_BW, start_B, num_valid_B):
    b, w = tokens_BW.shape
    positions_BW = start_B[:, None] + jnp.arange(w, dtype=jnp.int32)[None]
    valid_BW = jnp.arange(w)[None] < num_valid_B[:, None]
    x, cache = self._cached_pass(model, target, state.cache, g_BWD, tokens_BW, positions_BW,
                                 valid_BW)
    last_B = jnp.maximum(num_valid_B - 1, 0)
    x_last = x[jnp.arange(b), last_B]
    carry = jnp.where((num_valid_B > 0)[:, None], x_last,
                      state.carry_BD.astype(x.dtype)).astype(state.carry_BD.dtype)
    return state.replace(cache=cache.with_lengths(start_B + num_valid_B), carry_BD=carry)

  # ------------------------------------------------------------------ protocol

  def init(self, params, target, ctx, prefill_out):
    model = nnx.merge(self.graphdef, params)
    b, length = ctx.tokens_BL.shape
    cache = KVCache.for_model(model.layer_cfg, self.config.num_layers, b, length)
    g_BWD = model.fuse(prefill_out.taps_BTND, target)
    w = g_BWD.shape[1]
    g_BLD = jnp.zeros((b, length, g_BWD.shape[-1]), g_BWD.dtype)
    state = Eagle3State(cache, jnp.zeros((b, self.target_cfg.embed_dim), g_BWD.dtype),
                        g_BLD.at[:, :w].set(g_BWD[:, :length]))
    return self._catch_up(model, target, state, g_BWD, ctx.tokens_BL[:, 1:w + 1],
                          jnp.zeros((b,), jnp.int32), jnp.maximum(ctx.num_tokens_B - 1, 0))

  def idle_update(self, params, state, target, ctx, verify_out, start_B, num_accepted_B):
    """Records the fused taps of the verify window (positions start..start+γ)."""
    del ctx, num_accepted_B
    g_BGD = nnx.merge(self.graphdef, params).fuse(verify_out.taps_BTND, target)
    return state.replace(g_BLD=record_window(state.g_BLD, g_BGD, start_B))

  def update(self, params, state, target, ctx, verify_out, start_B, num_accepted_B):
    """Record, then write the committed entries (the committed count comes from ctx:
    num_accepted_B + 1 for live rows, less when a stop token or the budget cut it)."""
    state = self.idle_update(params, state, target, ctx, verify_out, start_B, num_accepted_B)
    return self.sync(params, state, target, ctx)

  def sync(self, params, state, target, ctx):
    """Writes recorded entries, γ+1 per trip, until the cache holds the n - 1 committed."""
    model = nnx.merge(self.graphdef, params)
    b, length = ctx.tokens_BL.shape
    rows = jnp.arange(b)[:, None]

    def trip(st, base_BW, committed_B):
      base_BW = jnp.minimum(base_BW, length - 1)
      tokens_BW = ctx.tokens_BL[rows, jnp.minimum(base_BW + 1, length - 1)]
      return self._catch_up(model, target, st, st.g_BLD[rows, base_BW], tokens_BW,
                            st.cache.lengths_B, committed_B)

    return sync_in_windows(state, ctx, self.num_draft + 1, trip, self.catch_up_width)

  def draft(self, params, state, target, ctx, key):
    """(draft tokens [B, G], draft-vocabulary logits [B, G, V'], q [B, G, V] or None)."""
    model = nnx.merge(self.graphdef, params)
    cache = state.cache
    n_B = ctx.num_tokens_B
    b = n_B.shape[0]
    slots_B1S = jnp.arange(cache.max_len)[None, None, :]
    # The chain is index n-2's TTT steps: its window counts from entry n-2.
    committed_BS = [(slots_B1S < (n_B - 1)[:, None, None]) & self.config.window_mask(
        i, (n_B - 2)[:, None, None], slots_B1S) for i in range(self.config.num_layers)]
    chain = [[] for _ in range(self.config.num_layers)]
    x_BD = state.carry_BD
    tokens, logits, qs = [], [], []
    for k in range(1, self.num_draft + 1):
      if k > 1:
        chain_B1C = jnp.ones((b, 1, k - 1), bool)

        def kv_fn_of(i, chain_B1C=chain_B1C):
          def kv_fn(k_new, v_new):
            mask_B1S = jnp.concatenate([committed_BS[i], chain_B1C], axis=-1)
            chain[i].append((k_new, v_new))
            dt = cache.k_LBSKD.dtype
            return (jnp.concatenate([cache.k_LBSKD[i]] + [c.astype(dt) for c, _ in chain[i]],
                                    axis=1),
                    jnp.concatenate([cache.v_LBSKD[i]] + [c.astype(dt) for _, c in chain[i]],
                                    axis=1), mask_B1S)
          return kv_fn

        positions_B1 = (n_B + k - 3)[:, None]
        x_BD = model.block(target, model.next_hidden(x_BD)[:, None], tokens[-1][:, None],
                           positions_B1, kv_fn_of)[:, 0]
      logits_BV = model.logits(x_BD[:, None])[:, 0]
      token_B, q_BV = pick_draft(model, logits_BV, ctx, jax.random.fold_in(key, k),
                                 self.sample_proposals)
      tokens.append(token_B)
      logits.append(logits_BV)
      qs.append(q_BV)
    q_BGV = None if qs[0] is None else jnp.stack(qs, axis=1)
    return jnp.stack(tokens, axis=1), jnp.stack(logits, axis=1), q_BGV

  def propose(self, params, state, target, ctx, key) -> Proposal:
    tokens_BG, _, q_BGV = self.draft(params, state, target, ctx, key)
    num_B = jnp.full((ctx.num_tokens_B.shape[0],), self.num_draft, jnp.int32)
    return Proposal(tokens_BG, num_B, q_BGV)

  def tree_proposer(self, top_k: int):
    """EAGLE-2's dynamic trees (`grow_tree`)."""
    return tree_proposers.BeamTrees(top_k)

  def grow_tree(self, params, state, target, ctx, grower, depth: int):
    """Expands `grower` through `depth` depths, the draft chain run per beam node: the
    root's children come from carry; the W beam nodes of depth j (j < depth) are W entries
    at position n-2+j, each reading next_hidden(its parent's x) and its token and
    attending to the committed cache, its ancestors' entries and itself (scratch K/V)."""
    model = nnx.merge(self.graphdef, params)
    cache = state.cache
    n_B = ctx.num_tokens_B
    b = n_B.shape[0]
    rows = jnp.arange(b)[:, None]
    slots_B1S = jnp.arange(cache.max_len)[None, None, :]
    committed_BS = [(slots_B1S < (n_B - 1)[:, None, None]) & self.config.window_mask(
        i, (n_B - 2)[:, None, None], slots_B1S) for i in range(self.config.num_layers)]
    scratch = [[] for _ in range(self.config.num_layers)]   # per layer: (k, v) per depth
    x_BWD = state.carry_BD[:, None]
    parent_BW, tokens_BW = grower.expand(model.logits(x_BWD), model.token_ids)
    anc_BWC = jnp.zeros((b, tokens_BW.shape[1], 0), bool)   # ancestors among the entries
    for j in range(1, depth):
      w = tokens_BW.shape[1]
      mask_BWS = [jnp.concatenate([jnp.broadcast_to(c, (b, w, cache.max_len)), anc_BWC,
                                   jnp.broadcast_to(jnp.eye(w, dtype=bool), (b, w, w))],
                                  axis=-1) for c in committed_BS]

      def kv_fn_of(i, mask_BWS=mask_BWS):
        def kv_fn(k_new, v_new):
          scratch[i].append((k_new, v_new))
          dt = cache.k_LBSKD.dtype
          return (jnp.concatenate([cache.k_LBSKD[i]] + [k.astype(dt) for k, _ in scratch[i]],
                                  axis=1),
                  jnp.concatenate([cache.v_LBSKD[i]] + [v.astype(dt) for _, v in scratch[i]],
                                  axis=1), mask_BWS[i])
        return kv_fn

      positions_BW = jnp.broadcast_to((n_B + j - 2)[:, None], (b, w))
      x_BWD = model.block(target, model.next_hidden(x_BWD[rows, parent_BW]), tokens_BW,
                          positions_BW, kv_fn_of)
      parent_BW, tokens_BW = grower.expand(model.logits(x_BWD), model.token_ids)
      anc_BWC = jnp.concatenate([anc_BWC[rows, parent_BW],
                                 jax.nn.one_hot(parent_BW, w, dtype=bool)], axis=-1)


def build(cfg, target):
  """(Eagle3Drafter, params) from `cfg.drafters.eagle3` (a dspec, speculators or legacy
  SafeAILab / SpecForge directory)."""
  c = cfg.drafters.eagle3
  model = load_eagle3(checkpoint_path(cfg, 'eagle3'), target_cfg=target.cfg)
  return Eagle3Drafter.create(model, c.num_draft, c.sample_proposals)
