"""Multi-Token Prediction depths (DeepSeek-V3 chained MTP; Gloeckle parallel heads).

Chained depth k (1-based) at position i reads the token t_{i+k} and the previous depth's
hidden h^{k-1}_i (h^0 = the target's hidden at i):

  x^k_i = Block_k( M_k [RMSNorm(emb(t_{i+k})) ; RMSNorm(h^{k-1}_i)] )   (causal over i,
  logits^k_i = head(FinalNorm_k(x^k_i))   -> predicts t_{i+k+1}          RoPE position i)

and hands h^k_i = FinalNorm_k(x^k_i) (chain_hidden='post_norm') or x^k_i ('pre_norm') to
depth k+1. The parallel variant (Gloeckle et al.) runs head k = one block on h^0 alone
(no token input, no chaining) and predicts the same t_{i+k+1}. Embedding and head are the
target's, passed in at call time and never copied, unless an imported checkpoint ships its
own per depth (`own_embedding` / `own_head`: DeepSeek-V3's `embed_tokens` and
`shared_head.head` when they differ from the main model's, `formats.mtp`).

A reduced draft vocabulary (`draft_vocab`, FastMTP / FR-Spec vocabulary compression) makes
the head score only those token ids (the head's rows of them); drafts map back to target
ids and q is placed into the full vocabulary by the drafter.
"""

from __future__ import annotations

import dataclasses
from typing import Tuple

import jax.numpy as jnp
from flax import nnx

from dspec import checkpoint
from dspec.models.config import DictConfig, TransformerConfig
from dspec.models.draft_vocab import DraftVocab
from dspec.models.layers import DecoderLayer, RMSNorm, rope_tables

_INIT = nnx.initializers.normal(stddev=0.02)
CHECKPOINT_KIND = 'mtp'
_CHOICES = {
    'kind': ('chained', 'parallel'),
    'concat_order': ('emb_first', 'hidden_first'),
    'h0_source': ('pre_norm', 'post_norm'),
    'chain_hidden': ('pre_norm', 'post_norm'),
}


@dataclasses.dataclass(frozen=True)
class MTPConfig(DictConfig):
  """Static MTP architecture (hashable). See docs/DESIGN.md, "Drafters".

  num_depths: D trained depths (1-4). h0_source: the target hidden fed to depth 1
  (post-final-norm, or the last layer's residual output). shared_depth: one depth module
  reused recursively for every depth (FastMTP); each depth still has its own KV cache.
  draft_vocab: sorted target token ids the head scores (() = the whole vocabulary).
  own_embedding / own_head: each depth module holds its own embedding [V, D] / head
  [D, V] instead of borrowing the target's (imported checkpoints only).
  """

  num_depths: int = 1
  kind: str = 'chained'
  concat_order: str = 'emb_first'
  h0_source: str = 'post_norm'
  chain_hidden: str = 'post_norm'
  zero_pos0_embedding: bool = False
  share_final_norm: bool = False
  shared_depth: bool = False
  draft_vocab: Tuple[int, ...] = ()
  own_embedding: bool = False
  own_head: bool = False

  def __post_init__(self):
    object.__setattr__(self, 'draft_vocab', tuple(int(i) for i in self.draft_vocab))
    if list(self.draft_vocab) != sorted(set(self.draft_vocab)):
      raise ValueError('mtp draft_vocab must be sorted distinct token ids')
    if not 1 <= self.num_depths <= 4:
      raise ValueError(f'mtp num_depths must be in 1..4, got {self.num_depths}')
    for name, allowed in _CHOICES.items():
      if getattr(self, name) not in allowed:
        raise ValueError(f'mtp {name} must be one of {allowed}, got {getattr(self, name)!r}')
    if self.kind == 'parallel' and self.shared_depth:
      raise ValueError('mtp shared_depth needs kind=chained (parallel heads do not recurse)')

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d['draft_vocab'] = list(d['draft_vocab'])
    return d

  @property
  def chained(self) -> bool:
    return self.kind == 'chained'

  def module_index(self, k: int) -> int:
    """Which depth module runs depth k (1-based)."""
    return 0 if self.shared_depth else k - 1

  def taps(self, target_cfg: TransformerConfig) -> tuple:
    """Target layers whose residual output the MTP reads (the last one for pre_norm h0)."""
    return (target_cfg.num_layers - 1,) if self.h0_source == 'pre_norm' else ()


class MTPDepth(nnx.Module):
  """One depth: input norms + projection (chained only), a decoder block, a final norm
  (and its own embedding / head when the config says so)."""

  def __init__(self, cfg: MTPConfig, tcfg: TransformerConfig, *, rngs: nnx.Rngs):
    d, pdt = tcfg.embed_dim, tcfg.param_dtype
    if cfg.chained:
      self.enorm = RMSNorm(d, eps=tcfg.norm_eps, param_dtype=pdt)
      self.hnorm = RMSNorm(d, eps=tcfg.norm_eps, param_dtype=pdt)
      self.eh_proj = nnx.Linear(2 * d, d, use_bias=False, kernel_init=_INIT,
                                dtype=tcfg.dtype, param_dtype=pdt, rngs=rngs)
    self.layer = DecoderLayer(tcfg, rngs=rngs)
    if not cfg.share_final_norm:
      self.final_norm = RMSNorm(d, eps=tcfg.norm_eps, param_dtype=pdt)
    if cfg.own_embedding:
      self.embed_tokens = nnx.Param(_INIT(rngs.params(), (tcfg.vocab_size, d), pdt))
    if cfg.own_head:
      self.head = nnx.Param(_INIT(rngs.params(), (d, tcfg.vocab_size), pdt))


class MTP(DraftVocab, nnx.Module):
  """D MTP depths for a target of shape `target_cfg` (embedding and head borrowed unless
  `own_embedding` / `own_head`)."""

  checkpoint_kind = CHECKPOINT_KIND

  def __init__(self, cfg: MTPConfig, target_cfg: TransformerConfig, *, rngs: nnx.Rngs):
    if cfg.draft_vocab and not 0 <= cfg.draft_vocab[0] <= cfg.draft_vocab[-1] < \
        target_cfg.vocab_size:
      raise ValueError(f'mtp draft_vocab ids must lie in [0, {target_cfg.vocab_size})')
    self.cfg = cfg
    self.target_cfg = target_cfg
    n = 1 if cfg.shared_depth else cfg.num_depths
    self.depths = nnx.List([MTPDepth(cfg, target_cfg, rngs=rngs) for _ in range(n)])

  @property
  def draft_vocab_size(self) -> int:
    return len(self.cfg.draft_vocab) or self.target_cfg.vocab_size

  def embed(self, target, k: int, tokens_BT):
    """Token embeddings for depth k (the target's unless own_embedding)."""
    if not self.cfg.own_embedding:
      return target.embed(tokens_BT)
    table_VD = self.depths[self.cfg.module_index(k)].embed_tokens[...]
    return jnp.take(table_VD, tokens_BT, axis=0).astype(self.target_cfg.dtype)

  def logits(self, target, k: int, hidden_BTD):
    """Draft-vocabulary logits [B, T, V'] (fp32) of depth k's post-norm hidden."""
    ids = jnp.asarray(self.cfg.draft_vocab, jnp.int32) if self.cfg.draft_vocab else None
    if not self.cfg.own_head:
      return target.logits(hidden_BTD, ids)
    w_DV = self.depths[self.cfg.module_index(k)].head[...]
    w_DV = w_DV if ids is None else jnp.take(w_DV, ids, axis=1)
    return jnp.einsum('btd,dv->btv', hidden_BTD, w_DV.astype(hidden_BTD.dtype),
                      preferred_element_type=jnp.float32)

  def h0(self, target_out):
    """Depth-1 hidden input from a TargetOutput (run with taps=cfg.taps(target_cfg))."""
    if self.cfg.h0_source == 'pre_norm':
      return target_out.taps_BTND[:, :, -1]
    return target_out.hidden_BTD

  def block(self, target, k: int, h_prev_BTD, tokens_BT, positions_BT, kv_fn):
    """Raw (pre-final-norm) output x^k of depth k; `kv_fn` as in `DecoderLayer`."""
    m = self.depths[self.cfg.module_index(k)]
    if self.cfg.chained:
      e = self.embed(target, k, tokens_BT)
      if self.cfg.zero_pos0_embedding:
        e = jnp.where((positions_BT == 0)[..., None], jnp.zeros_like(e), e)
      e, h = m.enorm(e), m.hnorm(h_prev_BTD.astype(e.dtype))
      x = m.eh_proj(jnp.concatenate([e, h] if self.cfg.concat_order == 'emb_first'
                                    else [h, e], axis=-1))
    else:
      x = h_prev_BTD
    sin, cos = rope_tables(positions_BT, self.target_cfg.head_dim, self.target_cfg.rope_theta)
    return m.layer(x, sin, cos, kv_fn)

  def final(self, target, k: int, x_BTD):
    """Post-final-norm hidden of depth k (the head's input)."""
    if self.cfg.share_final_norm:
      return target.norm(x_BTD)
    return self.depths[self.cfg.module_index(k)].final_norm(x_BTD)

  def chain(self, target, k: int, x_BTD):
    """What depth k hands to depth k+1."""
    return self.final(target, k, x_BTD) if self.cfg.chain_hidden == 'post_norm' else x_BTD

  def __call__(self, target, h0_BTD, tokens_BS, num_depths: int = 0):
    """Full causal pass (training): post-norm hidden of each depth, [B, T, D] each.

    h0_BTD: target hidden at positions 0..T-1; tokens_BS: the sequence t_0.. (S >= T);
    depth k reads t_{i+k} (zero past the end of tokens_BS). Depth k at position i predicts
    t_{i+k+1}; positions whose inputs or labels run past the data are the caller's to mask.
    """
    b, t, _ = h0_BTD.shape
    positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask_BTS = positions_BT[:, None, :] <= positions_BT[:, :, None]
    kv_fn = lambda k_, v_: (k_, v_, mask_BTS)
    h, outs = h0_BTD, []
    for k in range(1, (num_depths or self.cfg.num_depths) + 1):
      x = self.block(target, k, h if self.cfg.chained else h0_BTD,
                     shifted(tokens_BS, k, t), positions_BT, kv_fn)
      outs.append(self.final(target, k, x))
      h = self.chain(target, k, x)
    return outs


def shifted(x_BS, shift: int, length: int):
  """x[:, shift:shift + length], zero-padded on the right to `length`."""
  out = x_BS[:, shift:shift + length]
  pad = length - out.shape[1]
  return jnp.pad(out, ((0, 0), (0, pad))) if pad else out


def save_mtp(path, mtp: MTP, *, storage_dtype: str = 'float32', force: bool = False,
             extra: dict | None = None) -> None:
  """`checkpoint.save_model` with the MTP's and the target's configs."""
  checkpoint.save_model(path, mtp, kind=CHECKPOINT_KIND,
                        config={'mtp': mtp.cfg.to_dict(), 'target': mtp.target_cfg.to_dict()},
                        storage_dtype=storage_dtype, extra=extra, force=force)
