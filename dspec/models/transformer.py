"""The target LM: a Llama/Qwen3-family decoder in Flax NNX with a static KV cache."""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import jax.numpy as jnp
from flax import nnx

from dspec.models.config import TransformerConfig
from dspec.models.kv_cache import KVCache
from dspec.models.layers import DecoderLayer, RMSNorm, rope_tables

_EMBED_INIT = nnx.initializers.normal(stddev=0.02)


class TargetOutput(NamedTuple):
  """What one target forward returns.

  taps_BTND stacks the residual-stream outputs (before the final norm) of the requested
  layers along axis 2, in the order requested (layer -1: the embedding output, HF's
  hidden_states[0]); hidden_BTD is the post-final-norm hidden.
  """

  logits_BTV: Optional[jnp.ndarray]
  hidden_BTD: jnp.ndarray
  taps_BTND: jnp.ndarray
  cache: Optional[KVCache]


def final_normed_taps(taps_BTND, layer_ids, num_target_layers: int, target, kind: str):
  """`taps_BTND` with the taps of the target's last layer passed through its final norm
  (HF's `hidden_states[L]`, as z-lab and speculators read them); ValueError when such a tap
  exists and `target` is None."""
  last = num_target_layers - 1
  normed = [j for j, i in enumerate(layer_ids) if i == last]
  if not normed:
    return taps_BTND
  if target is None:
    raise ValueError(f'{kind} tap of the last target layer ({last}) is read after the '
                     'final norm: pass the target to fuse()')
  idx = jnp.asarray(normed)
  return taps_BTND.at[:, :, idx].set(target.norm(taps_BTND[:, :, idx]))


class Transformer(nnx.Module):
  """Decoder-only LM. Parameter names follow HF so import is a rename-free mapping."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed_tokens = nnx.Param(
        _EMBED_INIT(rngs.params(), (cfg.vocab_size, cfg.embed_dim), cfg.param_dtype))
    self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.norm = RMSNorm(cfg.embed_dim, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
    if not cfg.tie_embeddings:
      self.lm_head = nnx.Param(
          _EMBED_INIT(rngs.params(), (cfg.embed_dim, cfg.vocab_size), cfg.param_dtype))

  def init_cache(self, batch: int, max_len: int) -> KVCache:
    return KVCache.for_model(self.cfg, self.cfg.num_layers, batch, max_len)

  def embed(self, tokens_BT):
    return jnp.take(self.embed_tokens[...], tokens_BT, axis=0).astype(self.cfg.dtype)

  def logits(self, hidden_BTD, vocab_ids=None):
    """Head over post-norm hidden states, in fp32; over the token ids `vocab_ids` only
    (a reduced draft vocabulary, [V'] int) when given."""
    if self.cfg.tie_embeddings:
      w_VD = self.embed_tokens[...]
      w_DV = (w_VD if vocab_ids is None else jnp.take(w_VD, vocab_ids, axis=0)).T
    else:
      w_DV = self.lm_head[...]
      w_DV = w_DV if vocab_ids is None else jnp.take(w_DV, vocab_ids, axis=1)
    return jnp.einsum('btd,dv->btv', hidden_BTD, w_DV.astype(hidden_BTD.dtype),
                      preferred_element_type=jnp.float32)

  def __call__(self, tokens_BT, *, cache: Optional[KVCache] = None, positions_BT=None,
               taps: Sequence[int] = (), compute_logits: bool = True, slots_BT=None,
               mask_BTS=None) -> TargetOutput:
    """Runs the decoder.

    With `cache`, tokens sit at positions `cache.lengths_B + t`: their K/V are written there
    and each query attends to every cached position <= its own. `cache.lengths_B` is left
    unchanged; the caller commits (advances) lengths. Without a cache it is a full causal
    forward over `positions_BT` (default 0..T-1). A token tree (`decoding/tree.py`) passes
    the cache slots its K/V go to (`slots_BT`, default the positions) and the attention
    mask over the cache (`mask_BTS`, default causal by position).
    """
    b, t = tokens_BT.shape
    if positions_BT is None:
      start = cache.lengths_B[:, None] if cache is not None else jnp.zeros((b, 1), jnp.int32)
      positions_BT = start + jnp.arange(t, dtype=jnp.int32)[None, :]
    slots_BT = positions_BT if slots_BT is None else slots_BT
    sin, cos = rope_tables(positions_BT, self.cfg.head_dim, self.cfg.rope_theta)
    if mask_BTS is None:
      keys = positions_BT if cache is None else jnp.arange(cache.max_len)[None]
      mask_BTS = keys[:, None, :] <= positions_BT[:, :, None]

    x = self.embed(tokens_BT)
    tapped = {-1: x}
    for i, layer in enumerate(self.layers):
      if cache is None:
        kv_fn = lambda k, v: (k, v, mask_BTS)
      else:
        def kv_fn(k, v, i=i):
          nonlocal cache
          cache = cache.write(i, k, v, slots_BT)
          return cache.k_LBSKD[i], cache.v_LBSKD[i], mask_BTS
      x = layer(x, sin, cos, kv_fn)
      if i in taps:
        tapped[i] = x
    for i in taps:
      if not -1 <= i < self.cfg.num_layers:
        raise ValueError(f'tap layer {i} out of range for {self.cfg.num_layers} layers')
    taps_BTND = (jnp.stack([tapped[i] for i in taps], axis=2) if taps
                 else jnp.zeros((b, t, 0, self.cfg.embed_dim), x.dtype))
    hidden = self.norm(x)
    logits = self.logits(hidden) if compute_logits else None
    return TargetOutput(logits, hidden, taps_BTND, cache)
