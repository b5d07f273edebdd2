"""DFlash drafter: a block-diffusion (BD3-LM) drafter with KV injection (z-lab/dflash).

n decoder layers at the target's width with no embedding or head of their own (the target's,
frozen, are passed in at call time). Residual-stream outputs of some target layers ("taps")
are concatenated and fused by a bias-free linear + RMSNorm into one context tensor c. In
every draft layer the layer's OWN k/v projections (k-norm and RoPE at absolute positions)
are applied to c and those keys/values are placed beside the block's own: c enters only
through K/V, never the residual stream, and never goes through `input_layernorm`.

Three attention layouts, all through one call (`_attend`) so `attention_impl` picks the
kernel ('xla' dense reference or 'pallas'); every mask comes from
`pallas_kernels.block_attention`:

  drafting   Q = [anchor, MASK×(b−1)], KV = [context cache (C) | block (b)], DFlashDraftMask
  training   Q = N blocks of B, KV = [context (S) | N·B block keys], DFlashTrainMask
  BD3-LM     Q = x_t (L), KV = [x_t (L) | x_0 (L)], BD3LMContextMask: the clean half x_0
             is the injected target context (the target's features replace BD3-LM's
             clean copy, so x_0 is never queried)

z-lab's drafters (z-lab/dflash `dflash/model.py`; docs/DESIGN.md, "Checkpoint formats") are
represented exactly by the config fields `layer_types` / `is_causal` / `sliding_window`
(per-layer causal and per-query windowed masks, `dspec.models.dflash_masks`),
`input_embedding_scale`, `output_multiplier`, `final_logit_softcapping` and
`final_tap_normed`; the defaults are dspec's own drafters.
`dspec.models.formats.dflash.load_dflash` reads a dspec checkpoint or a z-lab / speculators
directory.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import jax.numpy as jnp
from flax import nnx

from dspec import checkpoint
from dspec.models.config import DictConfig, TransformerConfig
from dspec.models.draft_vocab import DraftVocab
from dspec.models.dflash_masks import DraftLayerMask, TrainLayerMask
from dspec.models.layers import DecoderLayer, RMSNorm, rope_tables
from dspec.models.transformer import final_normed_taps
from pallas_kernels.block_attention import (BD3LMMask, DFlashTrainMask, block_attention)

ATTENTION_IMPLS = ('xla', 'pallas', 'pallas_gpu', 'pallas_tpu', 'interpret')
CHECKPOINT_KIND = 'dflash'
LAYER_TYPES = ('full_attention', 'sliding_attention')


def default_target_layer_ids(num_target_layers: int, num_layers: int) -> Tuple[int, ...]:
  """`round(1 + i·(L−4)/(n−1))` for i < n (n = 1: [L//2]), clipped to [0, L−1], sorted."""
  big_l = num_target_layers
  if num_layers == 1:
    return (big_l // 2,)
  ids = {min(max(round(1 + i * (big_l - 4) / (num_layers - 1)), 0), big_l - 1)
         for i in range(num_layers)}
  return tuple(sorted(ids))


@dataclasses.dataclass(frozen=True)
class DFlashConfig(DictConfig):
  """Static shape of a DFlash drafter (the layer shapes come from the target's config).

  block_size: the trained block B (anchor + B−1 masks); inference may use a smaller one.
  target_layer_ids: 0-indexed target layers whose residual outputs are fused (taps), in
    the order of the fc input (z-lab's order; repeats allowed).
  sliding_window: without `layer_types`, None or how many context positions before the
    anchor every block slot sees (dspec's anchor-relative window); with `layer_types`,
    z-lab's per-query window W of the 'sliding_attention' layers.
  draft_vocab: () for the target's whole vocabulary, else the token ids the drafter may
    propose (FR-Spec / EAGLE-3 style reduced head: the most frequent target-written
    tokens). The head is the target's, restricted to these rows; the target still
    verifies over the full vocabulary, so output is unchanged, only drafts are limited.
  layer_types: () (dspec: every layer bidirectional) or one of LAYER_TYPES per layer
    (z-lab: sliding layers are windowed and causal unless `is_causal` says otherwise).
  is_causal: with `layer_types`, None (causal iff sliding) or a causality for all layers.
  input_embedding_scale: multiplies the embedded block tokens.
  output_multiplier, final_logit_softcapping: draft logits · multiplier, then
    c·tanh(logits / c) when c (> 0) is set.
  final_tap_normed: a tap of the target's last layer reads its post-final-norm hidden
    (HF's `hidden_states[L]`, what z-lab taps) instead of the residual stream.
  """

  num_layers: int
  block_size: int
  target_layer_ids: Tuple[int, ...]
  mask_token_id: int
  sliding_window: Optional[int] = None
  attention_impl: str = 'xla'
  draft_vocab: Tuple[int, ...] = ()
  layer_types: Tuple[str, ...] = ()
  is_causal: Optional[bool] = None
  input_embedding_scale: float = 1.0
  output_multiplier: float = 1.0
  final_logit_softcapping: Optional[float] = None
  final_tap_normed: bool = False

  def __post_init__(self):
    object.__setattr__(self, 'target_layer_ids', tuple(int(i) for i in self.target_layer_ids))
    object.__setattr__(self, 'draft_vocab', tuple(int(i) for i in self.draft_vocab))
    object.__setattr__(self, 'layer_types', tuple(self.layer_types))
    if self.layer_types and (len(self.layer_types) != self.num_layers or any(
        t not in LAYER_TYPES for t in self.layer_types)):
      raise ValueError(f'dflash layer_types must name one of {LAYER_TYPES} per layer '
                       f'({self.num_layers}), got {list(self.layer_types)}')
    if self.is_causal is not None and not self.layer_types:
      raise ValueError('dflash is_causal needs layer_types (z-lab attention semantics)')
    if self.final_logit_softcapping is not None and self.final_logit_softcapping <= 0:
      object.__setattr__(self, 'final_logit_softcapping', None)
    if len(set(self.draft_vocab)) != len(self.draft_vocab):
      raise ValueError('dflash draft_vocab has repeated token ids')
    if self.num_layers < 1 or self.block_size < 2:
      raise ValueError(f'dflash needs num_layers >= 1 and block_size >= 2, got '
                       f'{self.num_layers}, {self.block_size}')
    if not self.target_layer_ids:
      raise ValueError('dflash target_layer_ids must not be empty')
    if self.sliding_window is not None and self.sliding_window < 1:
      raise ValueError(f'dflash sliding_window must be None or >= 1, got {self.sliding_window}')
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f'dflash attention_impl must be one of {ATTENTION_IMPLS}, got '
                       f'{self.attention_impl!r}')

  @classmethod
  def create(cls, num_target_layers: int, num_layers: int, block_size: int,
             mask_token_id: int, target_layer_ids=None, sliding_window=None,
             attention_impl: str = 'xla', draft_vocab=(), **fields) -> 'DFlashConfig':
    """Fills the default taps for the target's depth when `target_layer_ids` is empty;
    `fields` sets the other dataclass fields."""
    ids = tuple(target_layer_ids or ()) or default_target_layer_ids(num_target_layers,
                                                                    num_layers)
    return cls(num_layers=num_layers, block_size=block_size, target_layer_ids=ids,
               mask_token_id=mask_token_id, sliding_window=sliding_window or None,
               attention_impl=attention_impl, draft_vocab=tuple(draft_vocab), **fields)

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    for name in ('target_layer_ids', 'draft_vocab', 'layer_types'):
      d[name] = list(d[name])
    return d

  def layer_attention(self, i: int) -> Tuple[bool, Optional[int], Optional[int]]:
    """(causal, per-query window, anchor-relative window) of draft layer i."""
    if not self.layer_types:
      return False, None, self.sliding_window
    sliding = self.layer_types[i] == 'sliding_attention'
    causal = sliding if self.is_causal is None else bool(self.is_causal)
    return causal, self.sliding_window if sliding else None, None

  def draft_masks(self, block_size: int) -> Tuple[DraftLayerMask, ...]:
    """Per-layer drafting masks of a block of `block_size` slots; their offsets are
    context_len [batch] or (context_len, block_len) [batch, 2]."""
    masks = []
    for i in range(self.num_layers):
      causal, window, anchor_window = self.layer_attention(i)
      masks.append(DraftLayerMask(block_size=block_size, causal=causal, window=window,
                                  anchor_window=anchor_window))
    return tuple(masks)

  def train_masks(self, context_len: int):
    """Per-layer training masks (Q = N·B blocks, KV = [context | blocks]; offsets are the
    anchors [batch, N]). dspec's own layouts keep `DFlashTrainMask`."""
    if not self.layer_types:
      return (DFlashTrainMask(block_size=self.block_size, context_len=context_len,
                              window=self.sliding_window),) * self.num_layers
    masks = []
    for i in range(self.num_layers):
      causal, window, _ = self.layer_attention(i)
      masks.append(TrainLayerMask(block_size=self.block_size, context_len=context_len,
                                  causal=causal, window=window))
    return tuple(masks)



@dataclasses.dataclass(frozen=True)
class BD3LMContextMask(BD3LMMask):
  """The x_t rows of the BD3-LM mask: Q = L noisy queries over KV = [x_t | x_0] (2L).

  Same written definition as `BD3LMMask` restricted to q < L: block-diagonal within x_t
  (own block, bidirectional) ∪ offset block-causal (x_0 blocks strictly before the
  query's block). With KV injection x_0 is the target context, which is never queried, so
  the block-causal x_0 rows are not computed.
  """

  def resolve(self, q_len, kv_len):
    if q_len != self.seq_len or kv_len != 2 * self.seq_len:
      raise ValueError(f'BD3LMContextMask(L={self.seq_len}) needs Q = L and KV = 2L; got '
                       f'Q={q_len}, KV={kv_len}.')
    return self


class DFlashModel(DraftVocab, nnx.Module):
  """The drafter's own weights: fusion (fc + hidden_norm), n decoder layers, final norm.

  `target_cfg` gives the layer shapes (`layer_cfg` is it with `num_layers` draft layers)
  and the target's width, vocabulary and depth. For a dspec-trained drafter it is the
  target's config; for an imported z-lab drafter it is built from the drafter's own
  config.json (its heads, head_dim, MLP width, RoPE; the target's width, vocabulary and
  `num_target_layers`).
  """

  checkpoint_kind = CHECKPOINT_KIND

  def __init__(self, cfg: DFlashConfig, target_cfg: TransformerConfig, *, rngs: nnx.Rngs):
    for i in cfg.target_layer_ids:
      if not 0 <= i < target_cfg.num_layers:
        raise ValueError(f'dflash tap layer {i} out of range for a '
                         f'{target_cfg.num_layers}-layer target')
    if not 0 <= cfg.mask_token_id < target_cfg.vocab_size:
      raise ValueError(f'dflash mask_token_id {cfg.mask_token_id} outside the target '
                       f'vocab of {target_cfg.vocab_size}')
    if cfg.draft_vocab and not 0 <= min(cfg.draft_vocab) <= max(cfg.draft_vocab) < \
        target_cfg.vocab_size:
      raise ValueError(f'dflash draft_vocab ids must lie in [0, {target_cfg.vocab_size})')
    self.cfg = cfg
    self.target_cfg = target_cfg
    self.layer_cfg = dataclasses.replace(target_cfg, num_layers=cfg.num_layers)
    d = target_cfg.embed_dim
    self.fc = nnx.Linear(len(cfg.target_layer_ids) * d, d, use_bias=False,
                         kernel_init=nnx.initializers.normal(stddev=0.02),
                         dtype=target_cfg.dtype,
                         param_dtype=target_cfg.param_dtype, rngs=rngs)
    self.hidden_norm = RMSNorm(d, eps=target_cfg.norm_eps,
                               param_dtype=target_cfg.param_dtype)
    self.layers = nnx.List([DecoderLayer(self.layer_cfg, rngs=rngs)
                            for _ in range(cfg.num_layers)])
    self.norm = RMSNorm(d, eps=target_cfg.norm_eps, param_dtype=target_cfg.param_dtype)

  def fuse(self, taps_BTND, target=None):
    """Tapped target features [B, T, n_taps, H] -> fused context [B, T, H].

    With `final_tap_normed`, taps of the target's last layer go through the target's final
    norm first (so `target` is needed when the taps include that layer).
    """
    if self.cfg.final_tap_normed:
      taps_BTND = final_normed_taps(taps_BTND, self.cfg.target_layer_ids,
                                    self.target_cfg.num_layers, target, 'dflash')
    b, t, n, d = taps_BTND.shape
    x = taps_BTND.reshape(b, t, n * d).astype(self.target_cfg.dtype)
    return self.hidden_norm(self.fc(x))

  def context_kv(self, context_BSD, positions_BS):
    """Every layer's own (k-normed, rotated) keys and values of the fused context.

    Returns k, v of shape [n_layers, B, S, kv_heads, head_dim].
    """
    sin, cos = rope_tables(positions_BS, self.layer_cfg.head_dim, self.layer_cfg.rope_theta)
    kvs = [layer.self_attn.project_kv(context_BSD, sin, cos) for layer in self.layers]
    return jnp.stack([k for k, _ in kvs]), jnp.stack([v for _, v in kvs])

  def draft_logits(self, target, hidden_BTD):
    """Logits [..., V'] over the draft vocabulary (the target's head restricted to it),
    times `output_multiplier` and soft-capped by `final_logit_softcapping` when set."""
    cfg = self.cfg
    vocab_ids = jnp.asarray(cfg.draft_vocab, jnp.int32) if cfg.draft_vocab else None
    logits = target.logits(hidden_BTD, vocab_ids)
    if cfg.output_multiplier != 1.0:
      logits = logits * cfg.output_multiplier
    if cfg.final_logit_softcapping is not None:
      cap = cfg.final_logit_softcapping
      logits = jnp.tanh(logits / cap) * cap
    return logits

  def _attend(self, q_BTHD, k_BSKD, v_BSKD, mask, offsets):
    impl = self.cfg.attention_impl
    return block_attention(q_BTHD, k_BSKD, v_BSKD, mask, offsets,
                           implementation=None if impl == 'pallas' else impl)

  def _mix_in(self, i: int, sublayer: str, h_BTD, slot_T):
    """Hook before sublayer ('attn' | 'mlp') of layer i: (input, state for `_mix_out`)."""
    del i, sublayer, slot_T
    return h_BTD, None

  def _mix_out(self, i: int, sublayer: str, out_BTD, state, slot_T):
    """Hook after sublayer ('attn' | 'mlp') of layer i, before the residual add."""
    del i, sublayer, state, slot_T
    return out_BTD

  def __call__(self, x_BTD, positions_BT, ctx_k_LBSKD, ctx_v_LBSKD, mask, offsets, *,
               context_first: bool = True, block_size: Optional[int] = None):
    """Runs the layers over embedded block tokens; returns the post-final-norm hidden.

    Keys/values of layer i are [context_i | block] (context_first) or [block | context_i].
    `mask` is one mask for every layer or a sequence of per-layer masks
    (`cfg.draft_masks`, `cfg.train_masks`). `block_size` is the length of the blocks the
    T rows are made of (None: one block of T), for layers that mix along the block.
    """
    masks = tuple(mask) if isinstance(mask, (tuple, list)) else (mask,) * len(self.layers)
    slot_T = jnp.arange(x_BTD.shape[1], dtype=jnp.int32) % (block_size or x_BTD.shape[1])
    if self.cfg.input_embedding_scale != 1.0:
      x_BTD = x_BTD * jnp.asarray(self.cfg.input_embedding_scale, x_BTD.dtype)
    sin, cos = rope_tables(positions_BT, self.layer_cfg.head_dim, self.layer_cfg.rope_theta)
    for i, layer in enumerate(self.layers):
      h, state = self._mix_in(i, 'attn', layer.input_layernorm(x_BTD), slot_T)
      q = layer.self_attn.project_q(h, sin, cos)
      k, v = layer.self_attn.project_kv(h, sin, cos)
      ctx_k, ctx_v = ctx_k_LBSKD[i].astype(k.dtype), ctx_v_LBSKD[i].astype(v.dtype)
      parts_k, parts_v = ([ctx_k, k], [ctx_v, v]) if context_first else ([k, ctx_k],
                                                                          [v, ctx_v])
      attn = self._attend(q, jnp.concatenate(parts_k, axis=1),
                          jnp.concatenate(parts_v, axis=1), masks[i], offsets)
      x_BTD = x_BTD + self._mix_out(i, 'attn', layer.self_attn.output(attn), state, slot_T)
      h, state = self._mix_in(i, 'mlp', layer.post_attention_layernorm(x_BTD), slot_T)
      x_BTD = x_BTD + self._mix_out(i, 'mlp', layer.mlp(h), state, slot_T)
    return self.norm(x_BTD)


def save_dflash(path, drafter: DFlashModel, *, storage_dtype: str = 'float32',
                force: bool = False, extra: dict | None = None) -> None:
  """`checkpoint.save_model` with the drafter's and the target's configs (kind 'dflash',
  or 'dflash2' for a DFlash-2 drafter)."""
  kind = drafter.checkpoint_kind
  checkpoint.save_model(path, drafter, kind=kind,
                        config={kind: drafter.cfg.to_dict(),
                                'target': drafter.target_cfg.to_dict()},
                        storage_dtype=storage_dtype, extra=extra, force=force)
