"""DFlash-2: the DFlash backbone with grouped dynamic causal convolutions and a candidate
selector (z-lab/dflash `dflash/model.py`: `GroupedDynamicCausalConv`, `CandidateSelector`;
docs/DESIGN.md, "Drafters").

Convolutions. Every draft layer wraps its attention and its MLP sublayer in one
`GroupedDynamicCausalConv`: "prepare" convolves the sublayer input, "finish" the sublayer
output, each with kernel_size taps along the block,

  y[i, c] = Σ_{t < K} (base[t, c] + δ[i, t, c // group_size]) · x[i − t, c],

causal along the block and zero across a block boundary (taps reaching before slot 0 of
the row's block read zeros). δ is one bias-free projection of the prepare input (shared by
both convs, so finish uses kernels computed before the sublayer). The fused target
context enters through K/V untouched. From scratch both convs are the identity (base
tap 0 = 1, other taps and the projection 0), i.e. exactly DFlash.

Candidate selector. Per draft slot the K best unary logits (the transformed draft logits)
are the candidates; a rank-r score couples each candidate b with the previous token a:

  S_t(a, b) = U_t(b) + Σ_r P[a, r] · (W h_t)[r] · Q[b, r]

with predecessor / successor codebooks P, Q [V, r] and the hidden projection W [r, H].
`select_walk` walks left to right from the anchor: argmax at T = 0; at T > 0 it samples
from softmax(S_t / T) over the K candidates and returns that q, conditioned on the drafted
prefix, so rejection sampling with it is exactly lossless.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from dspec.models.config import TransformerConfig
from dspec.models.dflash import DFlashConfig, DFlashModel
from dspec.sampling import top_k

CHECKPOINT_KIND = 'dflash2'
_INIT = nnx.initializers.normal(stddev=0.02)


@dataclasses.dataclass(frozen=True)
class DFlash2Config(DFlashConfig):
  """DFlashConfig plus the convolution (taps, channels per dynamic kernel) and the
  selector (rank r, candidates K). The reduced draft vocabulary is not supported."""

  conv_kernel_size: int = 2
  conv_group_size: int = 16
  selector_rank: int = 256
  selector_top_k: int = 16

  def __post_init__(self):
    super().__post_init__()
    if self.draft_vocab:
      raise ValueError('dflash2 needs the full vocabulary (draft_vocab must be empty)')
    for name in ('conv_kernel_size', 'conv_group_size', 'selector_rank', 'selector_top_k'):
      if getattr(self, name) < 1:
        raise ValueError(f'dflash2 {name} must be >= 1, got {getattr(self, name)}')


def grouped_causal_conv(x_BTD, delta_BTKG, base_KD, slot_T):
  """y[i, c] = Σ_t (base[t, c] + δ[i, t, c // group]) · x[i − t, c], taps reaching before
  the row's block slot 0 (slot_T[i] < t) being zero."""
  groups = delta_BTKG.shape[-1]
  group = x_BTD.shape[-1] // groups
  out = jnp.zeros_like(x_BTD)
  for t in range(base_KD.shape[0]):
    shifted = x_BTD if t == 0 else jnp.pad(x_BTD[:, :-t], ((0, 0), (t, 0), (0, 0)))
    shifted = jnp.where((slot_T >= t)[None, :, None], shifted, 0)
    delta = jnp.repeat(delta_BTKG[:, :, t], group, axis=-1).astype(x_BTD.dtype)
    out = out + base_KD[t].astype(x_BTD.dtype) * shifted + delta * shifted
  return out


class GroupedDynamicCausalConv(nnx.Module):
  """The prepare/finish convolution pair of one sublayer (identity at init)."""

  def __init__(self, dim: int, kernel_size: int, group_size: int, cfg: TransformerConfig, *,
               rngs: nnx.Rngs):
    if dim % group_size:
      raise ValueError(f'dflash2 conv_group_size {group_size} does not divide the width {dim}')
    self.kernel_size = kernel_size
    self.groups = dim // group_size
    base = jnp.zeros((2, kernel_size, dim), cfg.param_dtype).at[:, 0].set(1.0)
    self.base_kernel = nnx.Param(base)
    self.kernel_projection = nnx.Linear(dim, 2 * kernel_size * self.groups, use_bias=False,
                                        kernel_init=nnx.initializers.zeros_init(),
                                        dtype=cfg.dtype,
                                        param_dtype=cfg.param_dtype, rngs=rngs)

  def prepare(self, x_BTD, slot_T):
    """(convolved input, the finish conv's dynamic kernels [B, T, K, G])."""
    b, t, _ = x_BTD.shape
    delta = self.kernel_projection(x_BTD).reshape(b, t, 2, self.kernel_size, self.groups)
    base = self.base_kernel[...]
    return grouped_causal_conv(x_BTD, delta[:, :, 0], base[0], slot_T), delta[:, :, 1]

  def finish(self, out_BTD, delta_BTKG, slot_T):
    return grouped_causal_conv(out_BTD, delta_BTKG, self.base_kernel[...][1], slot_T)


class CandidateSelector(nnx.Module):
  """Hidden projection [H → r] and predecessor / successor codebooks [V, r]."""

  def __init__(self, dim: int, vocab: int, rank: int, cfg: TransformerConfig, *,
               rngs: nnx.Rngs):
    self.hidden_projection = nnx.Linear(dim, rank, use_bias=False, kernel_init=_INIT,
                                        dtype=cfg.dtype,
                                        param_dtype=cfg.param_dtype, rngs=rngs)
    self.predecessor_codebook = nnx.Param(_INIT(rngs.params(), (vocab, rank),
                                                cfg.param_dtype))
    self.successor_codebook = nnx.Param(_INIT(rngs.params(), (vocab, rank),
                                              cfg.param_dtype))

  def pair_scores(self, g_BTR, prev_BT, cand_BTK):
    """Σ_r P[prev, r] · g[r] · Q[cand, r] for every candidate: [B, T, K] (fp32)."""
    a_BTR = jnp.take(self.predecessor_codebook[...], prev_BT, axis=0).astype(jnp.float32)
    q_BTKR = jnp.take(self.successor_codebook[...], cand_BTK, axis=0).astype(jnp.float32)
    return jnp.einsum('btr,btkr->btk', a_BTR * g_BTR.astype(jnp.float32), q_BTKR,
                      precision=jax.lax.Precision.HIGHEST)

  def scores(self, unary_BTK, hidden_BTD, prev_BT, cand_BTK):
    """S = U + pair scores of the candidates given each slot's predecessor (teacher
    forcing in training; one slot at a time in `select_walk`)."""
    g_BTR = self.hidden_projection(hidden_BTD)
    return unary_BTK.astype(jnp.float32) + self.pair_scores(g_BTR, prev_BT, cand_BTK)


class DFlash2Model(DFlashModel):
  """DFlashModel with the two convolutions per layer and the candidate selector."""

  checkpoint_kind = CHECKPOINT_KIND

  def __init__(self, cfg: DFlash2Config, target_cfg: TransformerConfig, *, rngs: nnx.Rngs):
    super().__init__(cfg, target_cfg, rngs=rngs)
    d = target_cfg.embed_dim

    def conv():
      return GroupedDynamicCausalConv(d, cfg.conv_kernel_size, cfg.conv_group_size,
                                      target_cfg, rngs=rngs)

    self.attention_convs = nnx.List([conv() for _ in range(cfg.num_layers)])
    self.mlp_convs = nnx.List([conv() for _ in range(cfg.num_layers)])
    if cfg.selector_top_k > target_cfg.vocab_size:
      raise ValueError(f'dflash2 selector_top_k {cfg.selector_top_k} exceeds the vocab '
                       f'{target_cfg.vocab_size}')
    self.candidate_selector = CandidateSelector(d, target_cfg.vocab_size, cfg.selector_rank,
                                                target_cfg, rngs=rngs)

  def _conv(self, i, sublayer):
    return (self.attention_convs if sublayer == 'attn' else self.mlp_convs)[i]

  def _mix_in(self, i, sublayer, h_BTD, slot_T):
    return self._conv(i, sublayer).prepare(h_BTD, slot_T)

  def _mix_out(self, i, sublayer, out_BTD, state, slot_T):
    return self._conv(i, sublayer).finish(out_BTD, state, slot_T)


class SelectorWalk(NamedTuple):
  """The selector's block: tokens [B, G], the K candidates of each slot [B, G, K] and,
  when sampled, q over them [B, G, K] (None at T = 0: deterministic proposals)."""

  tokens_BG: jnp.ndarray
  cand_BGK: jnp.ndarray
  q_BGK: Optional[jnp.ndarray]

  def q_over_vocab(self, vocab_size: int):
    """q scattered onto the full vocabulary [B, G, V] (None at T = 0)."""
    if self.q_BGK is None:
      return None
    b, g, _ = self.cand_BGK.shape
    q = jnp.zeros((b, g, vocab_size), jnp.float32)
    return q.at[jnp.arange(b)[:, None, None], jnp.arange(g)[None, :, None],
                self.cand_BGK].add(self.q_BGK)


def select_walk(selector: CandidateSelector, num_candidates: int, logits_BGV, hidden_BGD,
                anchor_B, *, greedy: bool, temperature=None, key=None) -> SelectorWalk:
  """The left-to-right walk over the drafted slots 1..G from the anchor token.

  num_candidates: K; logits_BGV: the transformed draft logits (`draft_logits`) of the
  slots; hidden_BGD: their post-final-norm hidden. greedy: argmax of S; else temperature
  ([B] or scalar, > 0) and a PRNG key: each slot is sampled from softmax(S / T) over its
  candidates.
  """
  unary_BGK, cand_BGK = top_k(logits_BGV.astype(jnp.float32), num_candidates)
  cand_BGK = cand_BGK.astype(jnp.int32)
  g_BGR = selector.hidden_projection(hidden_BGD)
  b, g = cand_BGK.shape[:2]
  if not greedy:
    temp_B = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (b,))
    keys = jax.random.split(key, g)
  prev_B = anchor_B.astype(jnp.int32)
  tokens, qs = [], []
  for t in range(g):
    s_BK = unary_BGK[:, t] + selector.pair_scores(g_BGR[:, t:t + 1], prev_B[:, None],
                                                  cand_BGK[:, t:t + 1])[:, 0]
    if greedy:
      pick_B = jnp.argmax(s_BK, axis=-1)
    else:
      scaled_BK = s_BK / jnp.maximum(temp_B, 1e-6)[:, None]
      qs.append(jax.nn.softmax(scaled_BK, axis=-1))
      pick_B = jax.random.categorical(keys[t], scaled_BK, axis=-1)
    prev_B = jnp.take_along_axis(cand_BGK[:, t], pick_B[:, None], axis=-1)[:, 0]
    tokens.append(prev_B)
  return SelectorWalk(jnp.stack(tokens, axis=1), cand_BGK,
                      None if greedy else jnp.stack(qs, axis=1))


def propose_block(drafter: DFlash2Model, target, hidden_BGD, anchor_B, *, greedy: bool,
                  temperature=None, key=None) -> SelectorWalk:
  """DFlash-2's proposal from the drafter's block output: `hidden_BGD` = post-final-norm
  hidden of block slots 1..G (the drafter's output rows 1..b−1), `anchor_B` = the
  block's slot-0 token. Draft logits get the config's multiplier and soft cap first."""
  logits_BGV = drafter.draft_logits(target, hidden_BGD)
  return select_walk(drafter.candidate_selector, drafter.cfg.selector_top_k, logits_BGV,
                     hidden_BGD, anchor_B, greedy=greedy, temperature=temperature, key=key)
