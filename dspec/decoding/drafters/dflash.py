"""DFlash and DFlash-2 drafting (z-lab/dflash `dflash_generate`): one pass over the block.

State (`DFlashState`): per-layer context K/V of the draft (post k-norm, post RoPE) for
every committed position before the anchor, plus lengths (a `KVCache`), and the fused target
features of positions the cache has not taken in yet (`fused_BLD`). Only context K/V are
cached; block K/V are recomputed every round, so rollback is rewinding lengths.

  init     projects the prompt features at positions 0..P−1 (all committed before the
           anchor, the prefill's token).
  propose  block [anchor, MASK×(b−1)] at positions anchor..anchor+b−1 attends to the cached
           context and to the block (per-layer masks: bidirectional, causal or sliding, as
           the checkpoint says). The block is always whole, as in training (block attention
           is bidirectional, so a shorter block changes every slot's draft); the engine
           verifies only what the budget allows. `shrink_block` keeps z-lab's
           `dflash_generate` instead: near the end of the budget only the first
           remaining + 1 block keys exist. DFlash: argmax over slots 1..b−1,
           q = None. DFlash-2: the candidate selector's left-to-right walk (argmax at
           T = 0; at T > 0 sampled, with its q over the K candidates).
  update   appends the context K/V of the verify positions start..start+γ (the committed
           ones become visible by the new length num_tokens − 1; the rest are masked and
           overwritten next round).
  idle     at the controller's AR tier the update only records the fused features of the
           verify position; `sync`, before the next proposal, appends the recorded
           positions' K/V in windows of γ+1 (32 at once while far behind), so a stretch of
           AR steps runs no drafter layer until drafting resumes.

`denoise_steps > 1` (DFlash only) is iterative unmasking within the block: each step runs
the block, fills the most confident still-masked slots with their argmax (an equal share
per step), and the last step fills the rest. One step (the default) is the reference.

Checkpoints: a dspec checkpoint (kind dflash / dflash2) or a z-lab / speculators directory
(`dspec.models.formats.dflash`), detected from the files.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Tuple

import jax
import jax.numpy as jnp
from flax import nnx, struct

from dspec.decoding.drafter import (DrafterBase, check_num_draft, check_width_and_vocab,
                                    checkpoint_path, record_window, sync_in_windows)
from dspec.decoding import tree_proposers
from dspec.decoding.state import Proposal
from dspec.models import dflash as dflash_model
from dspec.models import dflash2
from dspec.models.config import TransformerConfig
from dspec.models.dflash import DFlashConfig
from dspec.models.formats.dflash import load_dflash
from dspec.models.kv_cache import KVCache


@struct.dataclass
class DFlashState:
  """cache: context K/V of the committed positions before the anchor (lengths n − 1 once
  synced); fused_BLD: fused target features recorded at tier 0 for a later `sync`."""

  cache: KVCache
  fused_BLD: jnp.ndarray

  LOGICAL_AXES: ClassVar[dict] = {'fused_BLD': ('batch', None, None)}


@dataclasses.dataclass(frozen=True)
class DFlashDrafter(DrafterBase):
  """Engine drafter around a DFlash model (`dspec.models.dflash`); params are
  `nnx.split(model)[1]`. It drafts `num_draft` tokens per step: the inference block is
  the anchor plus `num_draft` masks, at most the trained block.
  """

  truncate_for_tiers = True   # one pass drafts the block: tiers verify a prefix of it

  graphdef: Any
  config: DFlashConfig
  target_cfg: TransformerConfig
  num_draft: int
  denoise_steps: int = 1
  shrink_block: bool = False  # z-lab's block of min(b, remaining + 1) keys near the end
  catch_up_width: int = 32    # positions per catch-up trip after tier-0 stretches

  def __post_init__(self):
    check_num_draft('dflash', self.num_draft, 1, self.config.block_size - 1)
    if self.denoise_steps < 1:
      raise ValueError(f'drafters.dflash.denoise_steps must be >= 1, got '
                       f'{self.denoise_steps}')
    if self.denoise_steps > 1 and self.is_dflash2:
      raise ValueError('drafters.dflash.denoise_steps > 1 applies to DFlash, not DFlash-2')

  @property
  def is_dflash2(self) -> bool:
    return isinstance(self.config, dflash2.DFlash2Config)

  @property
  def samples_proposals(self) -> bool:
    return self.is_dflash2

  @classmethod
  def create(cls, model: dflash_model.DFlashModel, num_draft: int = 0,
             denoise_steps: int = 1,
             shrink_block: bool = False) -> Tuple["DFlashDrafter", Any]:
    """(drafter, params); num_draft 0 means the trained block size - 1."""
    graphdef, params = nnx.split(model)
    return cls(graphdef, model.cfg, model.target_cfg,
               num_draft or model.cfg.block_size - 1, denoise_steps, shrink_block), params

  @property
  def block_size(self) -> int:
    return self.num_draft + 1

  def tree_proposer(self, top_k: int):
    """Trees from one block pass: every slot's top-k (DFlash), or the candidate selector's
    beam over each slot's candidates (DFlash-2)."""
    if self.is_dflash2:
      return tree_proposers.SelectorTrees(top_k)
    return tree_proposers.BlockTopKTrees(top_k)

  @property
  def taps(self) -> Tuple[int, ...]:
    return self.config.target_layer_ids

  def check_target(self, target_cfg) -> None:
    mine = self.target_cfg
    check_width_and_vocab('dflash', mine, target_cfg)
    if target_cfg.num_layers != mine.num_layers:
      raise ValueError(f'dflash drafter taps layers {list(self.taps)} of a '
                       f'{mine.num_layers}-layer target, but the target has '
                       f'{target_cfg.num_layers} layers')

  # ------------------------------------------------------------------------ protocol

  def init(self, params, target, ctx, prefill_out):
    model = nnx.merge(self.graphdef, params)
    b, capacity = ctx.tokens_BL.shape
    cache = KVCache.for_model(model.layer_cfg, model.layer_cfg.num_layers, b, capacity)
    t = prefill_out.taps_BTND.shape[1]
    positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    fused_BTD = model.fuse(prefill_out.taps_BTND, target)
    cache = _append_context(model, cache, fused_BTD, positions_BT)
    fused_BLD = jnp.zeros((b, capacity, fused_BTD.shape[-1]), fused_BTD.dtype)
    return DFlashState(cache.with_lengths(ctx.num_tokens_B - 1), fused_BLD)

  def propose(self, params, state, target, ctx, key):
    model = nnx.merge(self.graphdef, params)
    cache = state.cache
    b = ctx.tokens_BL.shape[0]
    g = self.num_draft
    drafts_BG = jnp.full((b, g), self.config.mask_token_id, jnp.int32)
    if self.is_dflash2:
      hidden_BGD = self.block_hidden(model, cache, target, ctx, drafts_BG)
      walk = dflash2.propose_block(model, target, hidden_BGD, self._anchor(ctx),
                                   greedy=ctx.sampling.greedy, temperature=ctx.temperature,
                                   key=key)
      q_BGV = None
      if walk.q_BGK is not None:
        q_BGV = dflash2.SelectorWalk(walk.tokens_BG, model.token_ids(walk.cand_BGK),
                                     walk.q_BGK).q_over_vocab(self.target_cfg.vocab_size)
      return Proposal(model.token_ids(walk.tokens_BG), jnp.full((b,), g, jnp.int32), q_BGV)
    if self.denoise_steps == 1:
      return self.propose_prefix(params, state, target, ctx, key, g)
    masked_BG = jnp.ones((b, g), bool)
    steps = min(self.denoise_steps, g)
    for s in range(steps):
      logits_BGV = model.draft_logits(
          target, self.block_hidden(model, cache, target, ctx, drafts_BG))
      best_BG = model.token_ids(jnp.argmax(logits_BGV, axis=-1))
      if s == steps - 1:
        fill_BG = masked_BG
      else:
        conf_BG = jnp.max(jax.nn.log_softmax(logits_BGV, axis=-1), axis=-1)
        conf_BG = jnp.where(masked_BG, conf_BG, -jnp.inf)
        rank_BG = jnp.argsort(jnp.argsort(-conf_BG, axis=-1), axis=-1)
        count = (s + 1) * g // steps - s * g // steps
        fill_BG = masked_BG & (rank_BG < count)
      drafts_BG = jnp.where(fill_BG, best_BG, drafts_BG)
      masked_BG = masked_BG & ~fill_BG
    return Proposal(drafts_BG, jnp.full((b,), g, jnp.int32))

  def propose_prefix(self, params, state, target, ctx, key, num_draft: int) -> Proposal:
    """Single-pass DFlash scores only the first `num_draft` slots of the (whole) block:
    the same tokens as slicing `propose`, without the head over the rest."""
    if self.is_dflash2 or self.denoise_steps > 1:
      return super().propose_prefix(params, state, target, ctx, key, num_draft)
    model = nnx.merge(self.graphdef, params)
    b = ctx.tokens_BL.shape[0]
    masks_BG = jnp.full((b, self.num_draft), self.config.mask_token_id, jnp.int32)
    hidden_BGD = self.block_hidden(model, state.cache, target, ctx, masks_BG)[:, :num_draft]
    drafts_BG = model.token_ids(jnp.argmax(model.draft_logits(target, hidden_BGD), axis=-1))
    return Proposal(drafts_BG, jnp.full((b,), num_draft, jnp.int32))

  def update(self, params, state, target, ctx, verify_out, start_B, num_accepted_B):
    del num_accepted_B
    model = nnx.merge(self.graphdef, params)
    t = verify_out.taps_BTND.shape[1]
    positions_BT = start_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    cache = _append_context(model, state.cache, model.fuse(verify_out.taps_BTND, target),
                            positions_BT)
    return state.replace(cache=cache.with_lengths(ctx.num_tokens_B - 1))

  def idle_update(self, params, state, target, ctx, verify_out, start_B, num_accepted_B):
    """Records the fused features of the verify window for a later `sync`."""
    del ctx, num_accepted_B
    fused_BTD = nnx.merge(self.graphdef, params).fuse(verify_out.taps_BTND, target)
    return state.replace(fused_BLD=record_window(state.fused_BLD, fused_BTD, start_B))

  def sync(self, params, state, target, ctx):
    """Appends the recorded positions' K/V until the cache holds the n − 1 committed ones."""
    model = nnx.merge(self.graphdef, params)
    length = ctx.tokens_BL.shape[1]
    rows = jnp.arange(ctx.tokens_BL.shape[0])[:, None]

    def trip(st, base_BW, committed_B):
      fused_BWD = st.fused_BLD[rows, jnp.minimum(base_BW, length - 1)]
      cache = _append_context(model, st.cache, fused_BWD, base_BW)
      return st.replace(cache=cache.with_lengths(st.cache.lengths_B + committed_B))

    return sync_in_windows(state, ctx, self.num_draft + 1, trip, self.catch_up_width)

  # ------------------------------------------------------------------------- helpers

  def _anchor(self, ctx):
    return ctx.tokens_BL[jnp.arange(ctx.tokens_BL.shape[0]), ctx.num_tokens_B - 1]

  def block_hidden(self, model: dflash_model.DFlashModel, cache: KVCache, target, ctx,
                   drafts_BG):
    """The drafter's post-norm hidden [B, b−1, D] of slots 1..b−1 for the block
    [anchor, drafts_BG]: the whole block, or with `shrink_block` only its first
    min(b, remaining + 1) keys."""
    anchor_pos_B = ctx.num_tokens_B - 1
    block_BT = jnp.concatenate([self._anchor(ctx)[:, None], drafts_BG], axis=1)
    positions_BT = anchor_pos_B[:, None] + jnp.arange(self.block_size, dtype=jnp.int32)
    block_len_B = jnp.full_like(anchor_pos_B, self.block_size)
    if self.shrink_block:
      block_len_B = jnp.clip(ctx.remaining_B + 1, 1, self.block_size)
    offsets_B2 = jnp.stack([cache.lengths_B, block_len_B], axis=-1)
    hidden_BTD = model(target.embed(block_BT), positions_BT, cache.k_LBSKD, cache.v_LBSKD,
                       model.cfg.draft_masks(self.block_size), offsets_B2)
    return hidden_BTD[:, 1:]


def _append_context(model: dflash_model.DFlashModel, cache: KVCache, fused_BTD,
                    positions_BT):
  """Writes the context K/V of fused features at their absolute positions (all layers)."""
  k_LBTKD, v_LBTKD = model.context_kv(fused_BTD, positions_BT)
  for i in range(k_LBTKD.shape[0]):
    cache = cache.write(i, k_LBTKD[i], v_LBTKD[i], positions_BT)
  return cache


def build(cfg, target) -> Tuple[DFlashDrafter, Any]:
  """(drafter, params) from `cfg.drafters.dflash` (path, num_draft, denoise_steps, ...)."""
  c = cfg.drafters.dflash
  model = load_dflash(checkpoint_path(cfg, 'dflash'), attention_impl=c.attention_impl,
                      num_target_layers=target.cfg.num_layers)
  return DFlashDrafter.create(model, num_draft=c.num_draft, denoise_steps=c.denoise_steps,
                              shrink_block=c.shrink_block)
