"""Teacher-forced per-slot acceptance of any learned drafter on target-written rows.

For every decode anchor a of a row (the last committed token: a >= 1 with token a+1
target-written) the drafter drafts slots 1..K exactly as it drafts at T = 0 when tokens
0..a are committed: DFlash the argmax of its block pass, DFlash-2 the candidate selector's
walk, DSpark the Markov walk, EAGLE-3 and MTP their chain, each step reading the drafter's
own earlier drafts. Slot k hits when its draft is the row's token a+k (the rows are the
target's greedy continuations) and counts only where a+k is target-written. With fixed
verification of the K drafts, a step at that anchor accepts the leading run of hits.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dspec import drafter_kinds
from dspec.models.dflash import DFlashModel
from dspec.models.dflash2 import propose_block
from dspec.models.dspark import DSparkModel
from dspec.models.eagle3 import Eagle3Model
from dspec.models.mtp import MTP

# The kinds with a reader (their registrations' `slots`).
KINDS = tuple(sorted(kind.name for kind in drafter_kinds.KINDS if kind.slots))
ANCHORS_PER_CALL = 32
WALK_ROWS = 32    # held-out rows of the trainers' periodic walk


@dataclasses.dataclass(frozen=True)
class SlotTable:
  """Counts per draft slot k = 1..K over the anchors of held-out rows.

  reached_K: anchors with slot k target-written and slots < k all hit; passed_K: those
  whose slot k hit too; hit_K / valid_K: slot k hit / target-written regardless of earlier
  slots.
  """

  reached_K: np.ndarray
  passed_K: np.ndarray
  hit_K: np.ndarray
  valid_K: np.ndarray
  num_anchors: int
  walk_steps: int = 0        # the decode walk (`decode_walk`): verify steps ...
  walk_committed: int = 0    # ... and the tokens they commit

  @classmethod
  def from_hits(cls, hit_NK, valid_NK, walk_steps: int = 0,
                walk_committed: int = 0) -> 'SlotTable':
    hit_NK, valid_NK = np.asarray(hit_NK, bool), np.asarray(valid_NK, bool)
    run_NK = np.cumprod(hit_NK & valid_NK, axis=1).astype(bool)
    before_NK = np.concatenate([np.ones_like(run_NK[:, :1]), run_NK[:, :-1]], axis=1)
    reached_NK = valid_NK & before_NK
    return cls(reached_NK.sum(0), (reached_NK & hit_NK).sum(0),
               (hit_NK & valid_NK).sum(0), valid_NK.sum(0), len(hit_NK),
               int(walk_steps), int(walk_committed))

  @property
  def num_slots(self) -> int:
    return len(self.reached_K)

  @property
  def conditional(self) -> np.ndarray:
    """p(slot k hit | slots < k hit) [K] (0 where no anchor reached slot k)."""
    return self.passed_K / np.maximum(self.reached_K, 1)

  @property
  def start_hit(self) -> np.ndarray:
    """p(slots 1..k all hit) [K]: the product of the conditionals."""
    return np.cumprod(self.conditional)

  @property
  def marginal(self) -> np.ndarray:
    """p(slot k hit) [K], earlier slots regardless."""
    return self.hit_K / np.maximum(self.valid_K, 1)

  @property
  def tau(self) -> float:
    """1 + E[accepted drafts] at an anchor with fixed verification of the K drafts, every
    anchor (row position) weighted alike."""
    return 1.0 + float(np.sum(self.start_hit))

  @property
  def walk_tau(self) -> float:
    """Tokens per verify step of the decode walk: what a T = 0 decode of the rows' prompts
    commits per step (0 without a walk). It weights positions as decoding does: a stretch
    the drafter gets right takes few steps, where `tau` counts each of its positions."""
    return self.walk_committed / self.walk_steps if self.walk_steps else 0.0

  def to_dict(self) -> dict:
    return {'num_anchors': self.num_anchors, 'num_slots': self.num_slots, 'tau': self.tau,
            'walk_tau': self.walk_tau, 'walk_steps': self.walk_steps,
            'conditional': self.conditional.tolist(), 'start_hit': self.start_hit.tolist(),
            'marginal': self.marginal.tolist(), 'reached': self.reached_K.tolist(),
            'passed': self.passed_K.tolist()}


def anchor_block_hidden(drafter: DFlashModel, target, taps_BSND, tokens_BS, anchors_BN):
  """(post-norm hidden [B, N, b, D] of the blocks [token_a, MASK×(b−1)] at positions
  a..a+b−1 (b = the trained block) over the fused target context before each anchor a,
  positions [B, N, b]): one pass for every anchor, as at decode (anchor −1: invalid)."""
  cfg = drafter.cfg
  big_b = cfg.block_size
  b, s = tokens_BS.shape
  n = anchors_BN.shape[1]
  k_K = jnp.arange(big_b, dtype=jnp.int32)
  pos_BNK = anchors_BN[..., None] + k_K
  anchor_tok_BN = jnp.take_along_axis(tokens_BS, jnp.maximum(anchors_BN, 0), axis=1)
  block_BNK = jnp.where(k_K == 0, anchor_tok_BN[..., None], cfg.mask_token_id)
  context_BSD = drafter.fuse(taps_BSND, target)
  ctx_pos_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))
  ctx_k, ctx_v = drafter.context_kv(context_BSD, ctx_pos_BS)
  hidden_BQD = drafter(target.embed(block_BNK.reshape(b, n * big_b)),
                       pos_BNK.reshape(b, n * big_b), ctx_k, ctx_v, cfg.train_masks(s),
                       anchors_BN, block_size=big_b)
  return hidden_BQD.reshape(b, n, big_b, -1), pos_BNK


@dataclasses.dataclass(frozen=True)
class SlotReader:
  """How the tables read one drafter kind: num_slots(model) -> K, the drafts it proposes
  per step by default (registry `num_draft` 0); drafts(model, target, tokens_1S, anchors_1N,
  K) -> its T = 0 drafts [1, N, K] at anchors [1, N] (>= 1) of one row."""

  num_slots: Callable
  drafts: Callable


def kind_of(drafter) -> str:
  """The family name of a drafter module (its checkpoint kind)."""
  return drafter.checkpoint_kind


def _reader(drafter) -> SlotReader:
  return drafter_kinds.resolve(drafter_kinds.BY_NAME[kind_of(drafter)].slots, 'dspec.training')


def num_slots(drafter) -> int:
  """K: the drafts per step each family proposes by default (registry `num_draft` 0)."""
  return _reader(drafter).num_slots(drafter)


def _block_hidden(drafter, target, tokens_1S, anchors_1N):
  """(post-norm hidden [N, b, D] of the anchors' blocks, anchor tokens [N]) of a block
  drafter (one pass over all anchors' blocks)."""
  taps = target(tokens_1S, taps=drafter.cfg.target_layer_ids, compute_logits=False).taps_BTND
  hidden_1NBD, _ = anchor_block_hidden(drafter, target, taps, tokens_1S, anchors_1N)
  return hidden_1NBD[0], tokens_1S[0, anchors_1N[0]]


def _dflash_drafts(drafter, target, tokens_1S, anchors_1N, num_draft: int):
  """DFlash: the argmax of slots 1..b−1 of the block pass."""
  del num_draft
  hidden_NBD, _ = _block_hidden(drafter, target, tokens_1S, anchors_1N)
  logits_NGV = drafter.draft_logits(target, hidden_NBD[:, 1:])
  return drafter.token_ids(jnp.argmax(logits_NGV, axis=-1))[None]


def _dflash2_drafts(drafter, target, tokens_1S, anchors_1N, num_draft: int):
  """DFlash-2: the candidate selector's greedy walk over slots 1..b−1."""
  del num_draft
  hidden_NBD, anchor_N = _block_hidden(drafter, target, tokens_1S, anchors_1N)
  return drafter.token_ids(propose_block(drafter, target, hidden_NBD[:, 1:], anchor_N,
                                         greedy=True).tokens_BG)[None]


def _dspark_drafts(drafter: DSparkModel, target, tokens_1S, anchors_1N, num_draft: int):
  """DSpark: the Markov walk over the block's draft slots."""
  del num_draft
  hidden_NBD, anchor_N = _block_hidden(drafter, target, tokens_1S, anchors_1N)
  if not drafter.cfg.sample_from_anchor:   # DFlash's layout
    hidden_NBD = hidden_NBD[:, 1:]
  return drafter.walk(target, hidden_NBD, anchor_N).tokens_BG[None]


def _eagle3_drafts(drafter: Eagle3Model, target, tokens_1S, anchors_1N, num_draft: int):
  """[1, N, K] drafts of EAGLE-3: one training-time-test pass whose steps read the
  previous step's drafts (steps >= 1 attend only to their own index, so every anchor's
  chain runs at once); slot k at anchor a is step k−1 at index a−1."""
  out = target(tokens_1S, taps=drafter.cfg.target_layer_ids, compute_logits=False)
  logits = drafter.ttt_logits(target, drafter.fuse(out.taps_BTND, target), tokens_1S,
                              num_draft, own_drafts=True)
  at_1N = anchors_1N - 1
  return jnp.stack([jnp.take_along_axis(drafter.token_ids(jnp.argmax(l, axis=-1)), at_1N,
                                        axis=1) for l in logits], axis=-1)


def _mtp_drafts(drafter: MTP, target, tokens_1S, anchors_1N, num_draft: int):
  """[1, N, K] drafts of MTP: slot k is depth k at position a−1 on the row with tokens
  a+1..a+k−1 replaced by the drafts d_1..d_{k−1}, which is what the decode chain computes
  from the committed tokens 0..a (`MTPDrafter.draft`). Depth k's window reads drafts at
  several positions, so each anchor gets its own copy of the row."""
  s = tokens_1S.shape[1]
  n = anchors_1N.shape[1]
  rows_N = jnp.arange(n)
  anchors_N = anchors_1N[0]
  tokens_NS = jnp.broadcast_to(tokens_1S, (n, s))
  h0_1SD = drafter.h0(target(tokens_1S, taps=drafter.cfg.taps(target.cfg)))
  h0_NSD = jnp.broadcast_to(h0_1SD, (n,) + h0_1SD.shape[1:])
  drafts = []
  for k in range(1, num_draft + 1):
    hidden_NSD = drafter(target, h0_NSD, tokens_NS, k)[-1]
    logits_NV = drafter.logits(target, k, hidden_NSD[rows_N, anchors_N - 1][:, None])[:, 0]
    draft_N = drafter.token_ids(jnp.argmax(logits_NV, axis=-1))
    drafts.append(draft_N)
    tokens_NS = tokens_NS.at[rows_N, anchors_N + k].set(draft_N, mode='drop')
  return jnp.stack(drafts, axis=1)[None]


# Each kind's reader, named by its registration's `slots` (`dspec.drafter_kinds`).
DFLASH_SLOTS = SlotReader(lambda m: m.cfg.block_size - 1, _dflash_drafts)
DFLASH2_SLOTS = SlotReader(lambda m: m.cfg.block_size - 1, _dflash2_drafts)
DSPARK_SLOTS = SlotReader(lambda m: m.cfg.num_drafts, _dspark_drafts)
EAGLE3_SLOTS = SlotReader(lambda m: m.cfg.ttt_steps, _eagle3_drafts)
MTP_SLOTS = SlotReader(lambda m: m.cfg.num_depths, _mtp_drafts)


@functools.partial(jax.jit, static_argnames=('num_draft',))
def anchor_drafts(drafter, target, tokens_1S, anchors_1N, num_draft: int):
  """The T = 0 drafts [1, N, K] at anchors [1, N] of one row (anchors >= 1; K =
  `num_slots(drafter)`)."""
  return _reader(drafter).drafts(drafter, target, tokens_1S, anchors_1N, num_draft)


def decode_anchors(loss_mask_S) -> np.ndarray:
  """Positions a >= 1 whose next token is target-written (the anchors a decode meets)."""
  mask = np.asarray(loss_mask_S, bool)
  return np.flatnonzero(mask[2:]) + 1


def row_hits(drafter, target, tokens_S, loss_mask_S, anchors_N, num_draft: int):
  """(hit [N, K], valid [N, K]) of one row at the given anchors."""
  tokens_S = np.asarray(tokens_S, np.int32)
  mask_S = np.asarray(loss_mask_S, bool)
  s = len(tokens_S)
  anchors_N = np.asarray(anchors_N, np.int32)
  drafts = []
  for i in range(0, len(anchors_N), ANCHORS_PER_CALL):
    chunk = anchors_N[i:i + ANCHORS_PER_CALL]
    padded = np.pad(chunk, (0, ANCHORS_PER_CALL - len(chunk)), constant_values=chunk[-1])
    out = anchor_drafts(drafter, target, tokens_S[None], padded[None], num_draft)
    drafts.append(np.asarray(out[0, :len(chunk)]))
  drafts_NK = np.concatenate(drafts) if drafts else np.zeros((0, num_draft), np.int32)
  pos_NK = anchors_N[:, None] + np.arange(1, num_draft + 1)
  inside_NK = pos_NK < s
  safe_NK = np.minimum(pos_NK, s - 1)
  valid_NK = inside_NK & mask_S[safe_NK]
  return (drafts_NK == tokens_S[safe_NK]) & valid_NK, valid_NK


def decode_walk(anchors_N, hit_NK, valid_NK, start: int) -> tuple[int, int]:
  """(verify steps, committed tokens) of a T = 0 decode with fixed verification over a
  row, from its first verify anchor `start` (the prefill commits the first written token)
  while a whole block of K slots is target-written: each step commits its run of hits + 1.
  """
  run_N = np.cumprod(np.asarray(hit_NK) & np.asarray(valid_NK), axis=1).sum(axis=1)
  full_N = np.asarray(valid_NK).all(axis=1)
  index = {int(a): i for i, a in enumerate(anchors_N)}
  steps = committed = 0
  a = start
  while a in index and full_N[index[a]]:
    steps += 1
    committed += int(run_N[index[a]]) + 1
    a += int(run_N[index[a]]) + 1
  return steps, committed


def slot_table(drafter, target, tokens_RS, loss_mask_RS) -> SlotTable:
  """The table over every decode anchor of the rows, K = the family's default drafts,
  with the decode walk of each row."""
  k = num_slots(drafter)
  hits, valids, steps, committed = [], [], 0, 0
  for tokens_S, mask_S in zip(tokens_RS, loss_mask_RS):
    anchors_N = decode_anchors(mask_S)
    if len(anchors_N):
      hit, valid = row_hits(drafter, target, tokens_S, mask_S, anchors_N, k)
      hits.append(hit)
      valids.append(valid)
      row_steps, row_committed = decode_walk(anchors_N, hit, valid,
                                             int(np.argmax(mask_S)))
      steps, committed = steps + row_steps, committed + row_committed
  if not hits:
    raise ValueError('the rows have no target-written tokens to evaluate')
  return SlotTable.from_hits(np.concatenate(hits), np.concatenate(valids), steps, committed)


def walk_metrics(drafter, target, tokens_RS, loss_mask_RS, rows: int = WALK_ROWS) -> dict:
  """The trainers' decode-faithful eval over the first `rows` held-out rows: `walk_tau`
  (tokens per step of a T = 0 decode of the rows' prompts, fixed verification) beside
  `anchor_tau` (every anchor alike, as `tau_est` but over every anchor of the rows)."""
  table = slot_table(drafter, target, tokens_RS[:rows], loss_mask_RS[:rows])
  return {'walk_tau': table.walk_tau, 'anchor_tau': table.tau}
