"""DFlash drafter: a block-diffusion (BD3-LM) drafter with KV injection (`reference/dflash.md` §1).

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
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import jax.numpy as jnp
from flax import nnx

from dspec import checkpoint
from dspec.models.config import TransformerConfig
from dspec.models.layers import DecoderLayer, RMSNorm, rope_tables
from pallas_kernels.block_attention import BD3LMMask, block_attention

ATTENTION_IMPLS = ('xla', 'pallas', 'pallas_gpu', 'pallas_tpu', 'interpret')
CHECKPOINT_KIND = 'dflash'


def default_target_layer_ids(num_target_layers: int, num_layers: int) -> Tuple[int, ...]:
  """`round(1 + i·(L−4)/(n−1))` for i < n (n = 1: [L//2]), clipped to [0, L−1], sorted."""
  big_l = num_target_layers
  if num_layers == 1:
    return (big_l // 2,)
  ids = {min(max(round(1 + i * (big_l - 4) / (num_layers - 1)), 0), big_l - 1)
         for i in range(num_layers)}
  return tuple(sorted(ids))


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
  """Static shape of a DFlash drafter (the layer shapes come from the target's config).

  block_size: the trained block B (anchor + B−1 masks); inference may use a smaller one.
  target_layer_ids: 0-indexed target layers whose residual outputs are fused (taps).
  sliding_window: None, or how many context positions before the anchor are visible.
  draft_vocab: () for the target's whole vocabulary, else the token ids the drafter may
    propose (FR-Spec / EAGLE-3 style reduced head: the most frequent target-written
    tokens). The head is the target's, restricted to these rows; the target still
    verifies over the full vocabulary, so output is unchanged, only drafts are limited.
  """

  num_layers: int
  block_size: int
  target_layer_ids: Tuple[int, ...]
  mask_token_id: int
  sliding_window: Optional[int] = None
  attention_impl: str = 'xla'
  draft_vocab: Tuple[int, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, 'target_layer_ids', tuple(int(i) for i in self.target_layer_ids))
    object.__setattr__(self, 'draft_vocab', tuple(int(i) for i in self.draft_vocab))
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
             attention_impl: str = 'xla', draft_vocab=()) -> 'DFlashConfig':
    """Fills the default taps for the target's depth when `target_layer_ids` is empty."""
    ids = tuple(target_layer_ids or ()) or default_target_layer_ids(num_target_layers,
                                                                    num_layers)
    return cls(num_layers=num_layers, block_size=block_size, target_layer_ids=ids,
               mask_token_id=mask_token_id, sliding_window=sliding_window or None,
               attention_impl=attention_impl, draft_vocab=tuple(draft_vocab))

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d['target_layer_ids'] = list(self.target_layer_ids)
    d['draft_vocab'] = list(self.draft_vocab)
    return d

  @classmethod
  def from_dict(cls, d: dict) -> 'DFlashConfig':
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - fields
    if unknown:
      raise ValueError(f'unknown dflash config keys: {sorted(unknown)}')
    return cls(**d)


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


class DFlashDrafter(nnx.Module):
  """The drafter's own weights: fusion (fc + hidden_norm), n decoder layers, final norm."""

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
                         dtype=target_cfg.compute_dtype,
                         param_dtype=target_cfg.params_dtype, rngs=rngs)
    self.hidden_norm = RMSNorm(d, eps=target_cfg.norm_eps,
                               param_dtype=target_cfg.params_dtype)
    self.layers = nnx.List([DecoderLayer(self.layer_cfg, rngs=rngs)
                            for _ in range(cfg.num_layers)])
    self.norm = RMSNorm(d, eps=target_cfg.norm_eps, param_dtype=target_cfg.params_dtype)

  def fuse(self, taps_BTND):
    """Tapped target features [B, T, n_taps, H] -> fused context [B, T, H]."""
    b, t, n, d = taps_BTND.shape
    x = taps_BTND.reshape(b, t, n * d).astype(self.target_cfg.compute_dtype)
    return self.hidden_norm(self.fc(x))

  def context_kv(self, context_BSD, positions_BS):
    """Every layer's own (k-normed, rotated) keys and values of the fused context.

    Returns k, v of shape [n_layers, B, S, kv_heads, head_dim].
    """
    sin, cos = rope_tables(positions_BS, self.layer_cfg.head_dim, self.layer_cfg.rope_theta)
    kvs = [layer.self_attn.project_kv(context_BSD, sin, cos) for layer in self.layers]
    return jnp.stack([k for k, _ in kvs]), jnp.stack([v for _, v in kvs])

  def draft_logits(self, target, hidden_BTD):
    """Logits [..., V'] over the draft vocabulary (the target's head restricted to it)."""
    vocab_ids = jnp.asarray(self.cfg.draft_vocab, jnp.int32) if self.cfg.draft_vocab else None
    return target.logits(hidden_BTD, vocab_ids)

  def token_ids(self, index):
    """Token ids of draft-vocabulary indices (the identity for the full vocabulary)."""
    if not self.cfg.draft_vocab:
      return index.astype(jnp.int32)
    return jnp.asarray(self.cfg.draft_vocab, jnp.int32)[index]

  def draft_index(self, token_ids):
    """Draft-vocabulary index of each token id, −1 where the drafter cannot propose it."""
    if not self.cfg.draft_vocab:
      return token_ids.astype(jnp.int32)
    table_V = jnp.full((self.target_cfg.vocab_size,), -1, jnp.int32)
    table_V = table_V.at[jnp.asarray(self.cfg.draft_vocab)].set(
        jnp.arange(len(self.cfg.draft_vocab), dtype=jnp.int32))
    return table_V[token_ids]

  def _attend(self, q_BTHD, k_BSKD, v_BSKD, mask, offsets):
    impl = self.cfg.attention_impl
    return block_attention(q_BTHD, k_BSKD, v_BSKD, mask, offsets,
                           implementation=None if impl == 'pallas' else impl)

  def __call__(self, x_BTD, positions_BT, ctx_k_LBSKD, ctx_v_LBSKD, mask, offsets, *,
               context_first: bool = True):
    """Runs the layers over embedded block tokens; returns the post-final-norm hidden.

    Keys/values of layer i are [context_i | block] (context_first) or [block | context_i].
    """
    sin, cos = rope_tables(positions_BT, self.layer_cfg.head_dim, self.layer_cfg.rope_theta)
    for i, layer in enumerate(self.layers):
      h = layer.input_layernorm(x_BTD)
      q = layer.self_attn.project_q(h, sin, cos)
      k, v = layer.self_attn.project_kv(h, sin, cos)
      ctx_k, ctx_v = ctx_k_LBSKD[i].astype(k.dtype), ctx_v_LBSKD[i].astype(v.dtype)
      parts_k, parts_v = ([ctx_k, k], [ctx_v, v]) if context_first else ([k, ctx_k],
                                                                          [v, ctx_v])
      attn = self._attend(q, jnp.concatenate(parts_k, axis=1),
                          jnp.concatenate(parts_v, axis=1), mask, offsets)
      x_BTD = x_BTD + layer.self_attn.output(attn)
      x_BTD = x_BTD + layer.mlp(layer.post_attention_layernorm(x_BTD))
    return self.norm(x_BTD)


def save_dflash(path, drafter: DFlashDrafter, *, storage_dtype: str = 'float32',
                force: bool = False, extra: dict | None = None) -> None:
  """`checkpoint.save_model` with the drafter's and the target's configs."""
  checkpoint.save_model(path, drafter, kind=CHECKPOINT_KIND,
                        config={'dflash': drafter.cfg.to_dict(),
                                'target': drafter.target_cfg.to_dict()},
                        storage_dtype=storage_dtype, extra=extra, force=force)


def load_dflash(path, **overrides) -> DFlashDrafter:
  """Loads a `kind='dflash'` checkpoint; `overrides` replace DFlashConfig fields (e.g.
  attention_impl)."""
  metadata = checkpoint.read_model_metadata(path, CHECKPOINT_KIND)
  try:
    cfg = DFlashConfig.from_dict(metadata['config']['dflash'])
    target_cfg = TransformerConfig.from_dict(metadata['config']['target'])
  except (KeyError, TypeError, ValueError) as e:
    raise checkpoint.CheckpointError(f'{path}: bad dflash config in metadata ({e})') from e
  cfg = dataclasses.replace(cfg, **overrides)
  drafter = nnx.eval_shape(lambda: DFlashDrafter(cfg, target_cfg, rngs=nnx.Rngs(0)))
  checkpoint.load_model_state(path, drafter, CHECKPOINT_KIND)
  return drafter
