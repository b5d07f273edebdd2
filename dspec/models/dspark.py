"""DSpark: the DFlash backbone with a semi-autoregressive Markov head and a confidence head
(deepseek-ai/DeepSpec; speculators' `models/dspark`, SpecForge's `draft/dspark.py`).

Block. `sample_from_anchor=True` (speculators' default): anchor-first and all-predicting,
the block [anchor, MASK×(B−1)] sits at positions a..a+B−1 and slot k predicts the token
at a+k+1, so one block of B proposes B drafts. `sample_from_anchor=False`: DFlash's own
layout, slot 0 carries the anchor only and slots 1..B−1 predict a+1..a+B−1 (B−1 drafts),
so a DFlash export is this drafter with the heads at zero: fine-tuning from one starts at
its τ (`num_drafts`). The backbone (fusion, KV injection, per-layer masks) is
`DFlashModel`'s, unchanged.

Markov head. A rank-r logit bias from the previous token of the slot, x_{k−1} (x_{−1} =
the anchor, then the slot's predecessor draft), added to the backbone's draft logits:

  vanilla  bias = W2 · W1[x]
  gated    bias = W2 · (σ(G [h_k; W1[x]] + g) ⊙ W1[x])
  rnn      z = [s; W1[x]; h_k] → (gate, cand, out) = J z + j;
           s ← σ(gate) ⊙ s + (1 − σ(gate)) ⊙ tanh(cand) (s = 0 before slot 0);
           bias = W2 · tanh(out)

with W1 [V, r] over the target vocabulary (x is a target token id), W2 [r → V'] onto the
draft vocabulary (`draft_vocab`, a reduced head as speculators' d2t / t2d maps; V' = V
without one). Drafting applies it slot by slot from the anchor (`walk`),
greedy or sampled; the sampled distribution q (the biased logits through the target's
temperature / top-k / top-p) is handed to rejection sampling, so sampling stays exactly
lossless. Training uses teacher forcing (x = the data's token at a+k).

Confidence head. c_k = σ(wᵀ[h_k; W1[x_{k−1}]] + b) (without the W1 part when
`confidence_head_with_markov` is off): the probability that slot k is accepted given the
prefix was. The calibrated prefix survival S_k = Π_{j≤k} σ(z_j / T_j) uses per-slot
temperatures fitted on held-out data (sequential temperature scaling,
`dspec.training.dspark_task`) and stored with the checkpoint: `confidence_temperatures`
for sampled acceptance (the head's own target), `greedy_confidence_temperatures` for
greedy acceptance (draft argmax = target argmax), used at T = 0.

From scratch W2 is zero, so an untrained head is exactly DFlash's logits.

Formats: a dspec checkpoint (kind 'dspark', `save_dflash`) or speculators' DSpark form
(`dspec.models.formats.dspark`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspec.models.config import TransformerConfig
from dspec.models.dflash import DFlashConfig, DFlashModel
from dspec.sampling import processed_probs, sample_from_probs

CHECKPOINT_KIND = 'dspark'
HEAD_TYPES = ('vanilla', 'gated', 'rnn')
_INIT = nnx.initializers.normal(stddev=0.02)


@dataclasses.dataclass(frozen=True)
class DSparkConfig(DFlashConfig):
  """DFlashConfig plus the Markov head (rank r, variant), the confidence head and its
  calibration. `block_size` is the block B: B drafts anchor-first, B − 1 in DFlash's
  layout (`sample_from_anchor=False`)."""

  markov_rank: int = 256
  markov_head_type: str = 'vanilla'
  enable_confidence_head: bool = True
  confidence_head_with_markov: bool = True
  sample_from_anchor: bool = True
  confidence_temperatures: Tuple[float, ...] = ()
  greedy_confidence_temperatures: Tuple[float, ...] = ()

  def __post_init__(self):
    super().__post_init__()
    for name in ('confidence_temperatures', 'greedy_confidence_temperatures'):
      temps = tuple(float(t) for t in getattr(self, name))
      object.__setattr__(self, name, temps)
      if temps and (len(temps) != self.num_drafts or min(temps) <= 0):
        raise ValueError(f'dspark {name} must be {self.num_drafts} positive values (one per '
                         f'draft slot) or empty, got {list(temps)}')
    if not self.sample_from_anchor and self.markov_head_type == 'rnn':
      raise ValueError("dspark markov_head_type='rnn' needs sample_from_anchor=True (the "
                       "recurrent state's first step is the anchor-first block's slot 0)")
    if self.markov_rank < 0:
      raise ValueError(f'dspark markov_rank must be >= 0, got {self.markov_rank}')
    if self.markov_head_type not in HEAD_TYPES:
      raise ValueError(f'dspark markov_head_type must be one of {HEAD_TYPES}, got '
                       f'{self.markov_head_type!r}')
    if self.enable_confidence_head and self.confidence_head_with_markov and \
        self.markov_rank == 0:
      raise ValueError('dspark markov_rank is 0 but the confidence head reads the Markov '
                       'embedding (confidence_head_with_markov): set markov_rank > 0 or '
                       'confidence_head_with_markov=False')

  def to_dict(self) -> dict:
    d = super().to_dict()
    d['confidence_temperatures'] = list(self.confidence_temperatures)
    d['greedy_confidence_temperatures'] = list(self.greedy_confidence_temperatures)
    return d

  @property
  def num_drafts(self) -> int:
    """Drafts of one block: B anchor-first, B − 1 in DFlash's layout."""
    return self.block_size - (not self.sample_from_anchor)

  @property
  def confidence_input_dim_extra(self) -> int:
    return self.markov_rank if self.confidence_head_with_markov else 0


class _Table(nnx.Module):
  """An embedding table whose parameter is named `weight` (speculators' nn.Embedding)."""

  def __init__(self, rows: int, cols: int, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.weight = nnx.Param(nnx.initializers.normal(stddev=0.01)(
        rngs.params(), (rows, cols), cfg.param_dtype))


class MarkovHead(nnx.Module):
  """W1 [V, r], W2 [r → V'] and the gated / rnn variants' projection."""

  def __init__(self, vocab: int, draft_vocab: int, rank: int, dim: int, head_type: str,
               cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.head_type = head_type
    self.rank = rank
    linear = lambda i, o, **kw: nnx.Linear(i, o, dtype=jnp.float32,
                                           param_dtype=cfg.param_dtype, rngs=rngs, **kw)
    self.markov_w1 = _Table(vocab, rank, cfg, rngs=rngs)
    self.markov_w2 = linear(rank, draft_vocab, use_bias=False,
                            kernel_init=nnx.initializers.zeros_init())
    if head_type == 'gated':
      self.gate_proj = linear(dim + rank, rank, kernel_init=_INIT)
    elif head_type == 'rnn':
      self.joint_proj = linear(2 * rank + dim, 3 * rank, kernel_init=_INIT)

  def embed(self, tokens):
    """W1 rows of the previous tokens [..., r] (fp32)."""
    return jnp.take(self.markov_w1.weight[...], tokens, axis=0).astype(jnp.float32)

  def step(self, state_BR, emb_BR, hidden_BD):
    """(new rnn state, bias [.., V]) of one slot; vanilla/gated ignore the state."""
    hidden_BD = hidden_BD.astype(jnp.float32)
    if self.head_type == 'vanilla':
      latent = emb_BR
    elif self.head_type == 'gated':
      latent = jax.nn.sigmoid(self.gate_proj(jnp.concatenate([hidden_BD, emb_BR], -1))) * \
          emb_BR
    else:
      gate, cand, out = jnp.split(
          self.joint_proj(jnp.concatenate([state_BR, emb_BR, hidden_BD], -1)), 3, axis=-1)
      gate = jax.nn.sigmoid(gate)
      state_BR = gate * state_BR + (1.0 - gate) * jnp.tanh(cand)
      latent = jnp.tanh(out)
    return state_BR, self.markov_w2(latent)

  def block_bias(self, emb_BTR, hidden_BTD):
    """Teacher-forced bias [B, T, V] of one block per row (rnn state from zero at slot 0)."""
    if self.head_type != 'rnn':
      return self.step(None, emb_BTR, hidden_BTD)[1]
    state = jnp.zeros(emb_BTR.shape[:1] + (self.rank,), jnp.float32)
    out = []
    for k in range(emb_BTR.shape[1]):
      state, bias = self.step(state, emb_BTR[:, k], hidden_BTD[:, k])
      out.append(bias)
    return jnp.stack(out, axis=1)


class ConfidenceHead(nnx.Module):
  """proj: [h; W1[x]] (or h) → one acceptance logit."""

  def __init__(self, dim: int, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.proj = nnx.Linear(dim, 1, dtype=jnp.float32, param_dtype=cfg.param_dtype,
                           kernel_init=_INIT, rngs=rngs)

  def __call__(self, features):
    return self.proj(features)[..., 0]


class DSparkWalk(NamedTuple):
  """One drafted block: tokens [B, G], confidence logits [B, G] (None without the head)
  and, when sampled, the processed biased distribution q [B, G, V] (None at T = 0)."""

  tokens_BG: jnp.ndarray
  conf_logits_BG: Optional[jnp.ndarray]
  q_BGV: Optional[jnp.ndarray]


class DSparkModel(DFlashModel):
  """DFlashModel plus the Markov head (markov_rank > 0) and the confidence head."""

  checkpoint_kind = CHECKPOINT_KIND

  def __init__(self, cfg: DSparkConfig, target_cfg: TransformerConfig, *, rngs: nnx.Rngs):
    super().__init__(cfg, target_cfg, rngs=rngs)
    d = target_cfg.embed_dim
    self.markov_head = (MarkovHead(target_cfg.vocab_size,
                                   len(cfg.draft_vocab) or target_cfg.vocab_size,
                                   cfg.markov_rank, d, cfg.markov_head_type, target_cfg,
                                   rngs=rngs)
                        if cfg.markov_rank else None)
    self.confidence_head = (ConfidenceHead(d + cfg.confidence_input_dim_extra, target_cfg,
                                           rngs=rngs)
                            if cfg.enable_confidence_head else None)

  def _embed_prev(self, prev):
    return None if self.markov_head is None else self.markov_head.embed(prev)

  def _confidence(self, hidden, emb):
    if self.confidence_head is None:
      return None
    feats = hidden.astype(jnp.float32)
    if self.cfg.confidence_head_with_markov:
      feats = jnp.concatenate([feats, emb], axis=-1)
    return self.confidence_head(feats)

  def heads(self, target, hidden_BTD, prev_BT):
    """Teacher-forced (biased draft-vocabulary logits [B, T, V'] fp32, confidence logits
    [B, T] or None) of the draft slots of blocks (`cfg.num_drafts` each) laid out along T,
    given each slot's previous token (target ids)."""
    logits = self.draft_logits(target, hidden_BTD).astype(jnp.float32)
    emb = self._embed_prev(prev_BT)
    if self.markov_head is not None:
      b, t, _ = hidden_BTD.shape
      n, big_b = t // self.cfg.num_drafts, self.cfg.num_drafts
      bias = self.markov_head.block_bias(emb.reshape(b * n, big_b, -1),
                                         hidden_BTD.reshape(b * n, big_b, -1))
      logits = logits + bias.reshape(logits.shape)
    return logits, self._confidence(hidden_BTD, emb)

  def walk(self, target, hidden_BGD, anchor_B, *, sampling=None, temperature=None,
           top_p=None, key=None) -> DSparkWalk:
    """Drafts the block slot by slot from the anchor: argmax of the biased logits
    (`sampling` None or greedy), else a sample of their processed distribution q (placed
    into the target vocabulary). Tokens are target ids."""
    greedy = sampling is None or sampling.greedy
    base_BGV = self.draft_logits(target, hidden_BGD).astype(jnp.float32)
    b, g, _ = base_BGV.shape
    head = self.markov_head
    state = None if head is None else jnp.zeros((b, head.rank), jnp.float32)
    keys = None if greedy else jax.random.split(key, g)
    prev_B = anchor_B.astype(jnp.int32)
    tokens, confs, qs = [], [], []
    for k in range(g):
      emb = self._embed_prev(prev_B)
      logits_BV = base_BGV[:, k]
      if head is not None:
        state, bias = head.step(state, emb, hidden_BGD[:, k])
        logits_BV = logits_BV + bias
      confs.append(self._confidence(hidden_BGD[:, k], emb))
      if greedy:
        prev_B = self.token_ids(jnp.argmax(logits_BV, axis=-1))
      else:
        q_BV = processed_probs(logits_BV, sampling, temperature, top_p)
        prev_B = self.token_ids(sample_from_probs(keys[k], q_BV))
        qs.append(self.over_target_vocab(q_BV))
      tokens.append(prev_B)
    conf = None if self.confidence_head is None else jnp.stack(confs, axis=1)
    return DSparkWalk(jnp.stack(tokens, axis=1), conf,
                      None if greedy else jnp.stack(qs, axis=1))

  def survival(self, conf_logits_BG, greedy: bool = False):
    """Calibrated prefix survival S_k = Π_{j≤k} σ(z_j / T_j) [B, G] with the temperatures
    of sampled or (`greedy`, when fitted) greedy acceptance; T = 1 uncalibrated."""
    z = conf_logits_BG.astype(jnp.float32)
    temps = (greedy and self.cfg.greedy_confidence_temperatures) or \
        self.cfg.confidence_temperatures
    if temps:
      z = z / jnp.asarray(temps[:z.shape[-1]], jnp.float32)
    return jnp.cumprod(jax.nn.sigmoid(z), axis=-1)
