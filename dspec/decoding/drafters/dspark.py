"""DSpark drafting (deepseek-ai/DeepSpec, `dspec/models/dspark.py`): DFlash's one-pass
block, anchor-first, with the Markov head walked slot by slot, and a confidence-scheduled
verify length per row.

State (`DSparkState`): DFlash's (context K/V of every committed position before the anchor
and the features recorded at tier 0; `init` / `update` / `idle_update` / `sync` are
`drafters/dflash.py`'s) and the verify cost λ as a traced scalar.

propose  block [anchor, MASK×(b−1)] at positions anchor..anchor+b−1 (anchor-first: b =
         num_draft, slot k drafts the token at anchor+k+1; DFlash's layout: b = num_draft
         + 1, slot k ≥ 1 drafts anchor+k), always the whole block, as in training
         (`shrink_block`: z-lab's shrinking block, only the first `remaining` keys near
         the end of the budget); a row verifies at most `remaining` drafts. The Markov walk picks each
         slot's token from its biased logits (argmax at T = 0; at T > 0 a sample, with
         q = the processed biased distribution for rejection sampling) and the confidence
         head scores it; the row then verifies only its first n_r drafts.

Verify length (`verify_lengths`). With the calibrated prefix survival S_k (the probability
that drafts 1..k are all accepted; greedy or sampled calibration by the decoding mode),
verifying n drafts commits E(n) = 1 + Σ_{k≤n} S_k tokens in expectation. Cost model: a step
costs c0 · (1 + λ·n) — c0 the fixed cost (draft pass, the anchor's verify row, engine
overhead), λ the marginal cost of one more verified token relative to c0 (≈ 0 when
verification is memory-bound, batch 1 on an accelerator; → 1 when it is compute-bound,
large batches or CPU). Each row takes the n maximising E(n) / (1 + λ·n). With
`verify_budget` > 0 a batch-level token budget then admits the globally best (row, slot)
pairs by S (a prefix of every row, as S falls along the block), at most `verify_budget`
drafts per step. The verify shape stays static (rows verify a prefix of it), and under
`verify_length=auto` the controller's tiers cap n_r. Without a confidence head every row
verifies its whole block.

Where λ comes from. `init` sets it to `verify_cost` (the config value): that is λ with
`verify_length=fixed`. Under `verify_length=auto` the load-aware controller
(`dspec/decoding/controller.py`) replaces it, once per `generate` after profiling, with
λ(B) fitted to its step-cost table at the batch size B (`CostTable.verify_cost`: least
squares of cost(B, γ) ≈ c0·(1 + λ·γ) over the tiers, clipped at 0) through
`set_verify_cost`; the table's λ(B) wins over `verify_cost` there. λ lives in the drafter
state, a traced scalar, so a new value recompiles nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from dspec.decoding import tree_proposers
from dspec.decoding.drafter import (DrafterBase, check_num_draft, check_width_and_vocab,
                                    checkpoint_path)
from dspec.decoding.drafters.dflash import DFlashDrafter, DFlashState
from dspec.decoding.state import Proposal
from dspec.models import dspark as dspark_model
from dspec.models.formats.dspark import load_dspark


@struct.dataclass
class DSparkState(DFlashState):
  """DFlash's state; verify_cost: λ of the verify-length rule (f32 scalar)."""

  verify_cost: jnp.ndarray

  LOGICAL_AXES: ClassVar[dict] = {**DFlashState.LOGICAL_AXES, 'verify_cost': ()}


def verify_lengths(survival_BG, limit_B, verify_cost, verify_budget: int = 0):
  """Per-row verify length n_r [B]: argmax_n (1 + Σ_{k≤n} S_k) / (1 + λ·n) over
  n ≤ limit_r (λ = `verify_cost`, a float or traced scalar), then at most `verify_budget`
  (row, slot) pairs in all (0: no budget), the largest S first."""
  b, g = survival_BG.shape
  s = survival_BG.astype(jnp.float32)
  n_G1 = jnp.arange(g + 1, dtype=jnp.int32)
  expected_BG1 = 1.0 + jnp.concatenate([jnp.zeros((b, 1)), jnp.cumsum(s, axis=1)], axis=1)
  rate_BG1 = expected_BG1 / (1.0 + verify_cost * n_G1.astype(jnp.float32))
  rate_BG1 = jnp.where(n_G1[None] <= limit_B[:, None], rate_BG1, -jnp.inf)
  n_B = jnp.argmax(rate_BG1, axis=1).astype(jnp.int32)
  if verify_budget and verify_budget < b * g:
    score = jnp.where(n_G1[None, :g] < n_B[:, None], s, -1.0).reshape(-1)
    top, idx = jax.lax.top_k(score, verify_budget)   # ties: lower slot first (a prefix)
    admitted = jnp.zeros((b * g,), bool).at[idx].set(top >= 0).reshape(b, g)
    n_B = jnp.sum(admitted, axis=1).astype(jnp.int32)
  return n_B


@dataclasses.dataclass(frozen=True)
class DSparkDrafter(DFlashDrafter):
  """Engine drafter around a `DSparkModel`; params are `nnx.split(model)[1]`. It drafts
  `num_draft` tokens per step (at most the trained block's drafts) with a block of
  num_draft slots, or num_draft + 1 in DFlash's layout."""

  verify_cost: float = 0.1    # λ with verify_length=fixed (auto: the controller's λ(B))
  verify_budget: int = 0

  def __post_init__(self):
    check_num_draft('dspark', self.num_draft, 1, self.config.num_drafts)
    if self.verify_cost < 0:
      raise ValueError(f'drafters.dspark.verify_cost must be >= 0, got {self.verify_cost}')
    if self.verify_budget < 0:
      raise ValueError(f'drafters.dspark.verify_budget must be >= 0 (0: no budget), got '
                       f'{self.verify_budget}')

  @property
  def is_dflash2(self) -> bool:
    return False

  @property
  def samples_proposals(self) -> bool:
    return True

  @classmethod
  def create(cls, model: dspark_model.DSparkModel, num_draft: int = 0,
             verify_cost: float = 0.1, verify_budget: int = 0,
             shrink_block: bool = False) -> Tuple["DSparkDrafter", Any]:
    """(drafter, params); num_draft 0 means the trained block's drafts."""
    graphdef, params = nnx.split(model)
    return cls(graphdef, model.cfg, model.target_cfg, num_draft or model.cfg.num_drafts,
               shrink_block=shrink_block, verify_cost=verify_cost,
               verify_budget=verify_budget), params

  @property
  def block_size(self) -> int:
    return self.num_draft + (not self.config.sample_from_anchor)

  def check_target(self, target_cfg) -> None:
    mine = self.target_cfg
    check_width_and_vocab('dspark', mine, target_cfg)
    if target_cfg.num_layers != mine.num_layers:
      raise ValueError(f'dspark drafter taps layers {list(self.taps)} of a '
                       f'{mine.num_layers}-layer target, but the target has '
                       f'{target_cfg.num_layers} layers')

  def init(self, params, target, ctx, prefill_out):
    state = super().init(params, target, ctx, prefill_out)
    return DSparkState(state.cache, state.fused_BLD,
                       jnp.asarray(self.verify_cost, jnp.float32))

  def set_verify_cost(self, state: DSparkState, verify_cost: float) -> DSparkState:
    """`state` with λ = `verify_cost` (the load-aware controller's λ(B))."""
    return state.replace(verify_cost=jax.device_put(np.float32(max(verify_cost, 0.0))))

  propose_prefix = DrafterBase.propose_prefix   # the Markov walk needs every slot

  def propose(self, params, state, target, ctx, key):
    model = nnx.merge(self.graphdef, params)
    walk = self.draft(model, state.cache, target, ctx, key)
    n_B = jnp.clip(ctx.remaining_B, 1, self.num_draft).astype(jnp.int32)
    if walk.conf_logits_BG is not None:
      greedy = ctx.sampling is None or ctx.sampling.greedy
      n_B = verify_lengths(model.survival(walk.conf_logits_BG, greedy), n_B,
                           state.verify_cost, self.verify_budget)
    return Proposal(walk.tokens_BG, n_B, walk.q_BGV)

  def draft(self, model: dspark_model.DSparkModel, cache, target, ctx, key):
    """The Markov walk over the block."""
    hidden_BTD = self._block_hidden(model, cache, target, ctx)
    return model.walk(target, hidden_BTD, self._anchor(ctx), sampling=ctx.sampling,
                      temperature=ctx.temperature, top_p=ctx.top_p, key=key)

  def _block_hidden(self, model: dspark_model.DSparkModel, cache, target, ctx):
    """The draft slots' hidden [B, num_draft, D]: the whole block, or with `shrink_block`
    only its first min(b, remaining) keys (DFlash's: `block_hidden`)."""
    if not self.config.sample_from_anchor:
      masks_BG = jnp.full((ctx.tokens_BL.shape[0], self.num_draft), self.config.mask_token_id,
                          jnp.int32)
      return self.block_hidden(model, cache, target, ctx, masks_BG)
    b = self.block_size
    anchor_B = self._anchor(ctx)
    anchor_pos_B = ctx.num_tokens_B - 1
    block_BT = jnp.full((anchor_B.shape[0], b), self.config.mask_token_id, jnp.int32)
    block_BT = block_BT.at[:, 0].set(anchor_B)
    positions_BT = anchor_pos_B[:, None] + jnp.arange(b, dtype=jnp.int32)
    block_len_B = jnp.full_like(anchor_pos_B, b)
    if self.shrink_block:
      block_len_B = jnp.clip(ctx.remaining_B, 1, b).astype(jnp.int32)
    offsets_B2 = jnp.stack([cache.lengths_B, block_len_B], axis=-1)
    return model(target.embed(block_BT), positions_BT, cache.k_LBSKD, cache.v_LBSKD,
                 model.cfg.draft_masks(b), offsets_B2)

  def tree_proposer(self, top_k: int):
    """Beam trees over the Markov walk (`grow_tree`), EAGLE-2's as for EAGLE-3."""
    return tree_proposers.BeamTrees(top_k)

  def grow_tree(self, params, state, target, ctx, grower, depth: int):
    """Expands `grower` through `depth` slots of one block pass: slot k's logits plus the
    Markov head's bias given each beam node's own path (its token and recurrent state)."""
    model = nnx.merge(self.graphdef, params)
    hidden_BTD = self._block_hidden(model, state.cache, target, ctx)
    base_BGV = model.draft_logits(target, hidden_BTD).astype(jnp.float32)
    head = model.markov_head
    b = base_BGV.shape[0]
    rows = jnp.arange(b)[:, None]
    prev_BW = self._anchor(ctx)[:, None]
    markov_BWR = None if head is None else jnp.zeros((b, 1, head.rank), jnp.float32)
    for k in range(depth):
      w = prev_BW.shape[1]
      logits_BWV = jnp.broadcast_to(base_BGV[:, k, None], (b, w, base_BGV.shape[2]))
      if head is not None:
        hidden_WD = jnp.broadcast_to(hidden_BTD[:, k, None], (b, w, hidden_BTD.shape[2]))
        markov_NR, bias_NV = head.step(markov_BWR.reshape(b * w, -1),
                                       head.embed(prev_BW.reshape(-1)),
                                       hidden_WD.reshape(b * w, -1))
        logits_BWV = logits_BWV + bias_NV.reshape(b, w, -1)
        markov_BWR = markov_NR.reshape(b, w, -1)
      parent_BW, prev_BW = grower.expand(logits_BWV, model.token_ids)
      if head is not None:
        markov_BWR = markov_BWR[rows, parent_BW]


def build(cfg, target) -> Tuple[DSparkDrafter, Any]:
  """(drafter, params) from `cfg.drafters.dspark` (path, num_draft, verify_cost, ...)."""
  c = cfg.drafters.dspark
  model = load_dspark(checkpoint_path(cfg, 'dspark'), attention_impl=c.attention_impl,
                      num_target_layers=target.cfg.num_layers)
  return DSparkDrafter.create(model, num_draft=c.num_draft, verify_cost=c.verify_cost,
                              verify_budget=c.verify_budget, shrink_block=c.shrink_block)
