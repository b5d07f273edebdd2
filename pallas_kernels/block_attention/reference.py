"""Dense XLA reference attention with a computable mask (the 'xla' backend)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.block_attention import masks as masks_lib

# Finite, so that fully masked rows never produce inf - inf.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def dense_mask(mask: masks_lib.AttentionMask, offsets, batch: int, q_len: int,
               kv_len: int) -> jax.Array:
  """``[batch, Q, KV]`` bool mask, the mask function evaluated on an iota grid."""
  mask = mask.resolve(q_len, kv_len)
  offsets_B = mask.prepare_offsets(offsets, batch, q_len)
  q_idx = jnp.arange(q_len, dtype=jnp.int32)[:, None]
  kv_idx = jnp.arange(kv_len, dtype=jnp.int32)[None, :]
  return jax.vmap(lambda off: mask(q_idx, kv_idx, off))(offsets_B)


def reference_attention(q_BTHD: jax.Array, k_BSKD: jax.Array,
                        v_BSKD: jax.Array, mask: masks_lib.AttentionMask,
                        offsets=None, scale: float | None = None) -> jax.Array:
  """Masked softmax attention with GQA, computed densely in fp32.

  Args:
    q_BTHD: queries ``[batch, T, H, D]``.
    k_BSKD, v_BSKD: keys and values ``[batch, S, K, D]``, H % K == 0.
    mask: an ``AttentionMask``.
    offsets: the mask's runtime offsets (see ``masks``).
    scale: logit scale, default ``D ** -0.5``.

  Returns:
    ``[batch, T, H, D]`` in the dtype of ``q_BTHD``. Fully masked query rows are
    zero and get zero gradients.
  """
  batch, q_len, num_heads, head_dim = q_BTHD.shape
  kv_len, num_kv_heads = k_BSKD.shape[1], k_BSKD.shape[2]
  groups = num_heads // num_kv_heads
  scale = head_dim**-0.5 if scale is None else scale
  visible_BTS = dense_mask(mask, offsets, batch, q_len, kv_len)
  q_BTKGD = q_BTHD.reshape(batch, q_len, num_kv_heads, groups, head_dim)
  logits_BKGTS = jnp.einsum(
      'btkgd,bskd->bkgts', q_BTKGD, k_BSKD,
      preferred_element_type=jnp.float32,
      precision=jax.lax.Precision.HIGHEST) * scale
  visible = visible_BTS[:, None, None]
  logits_BKGTS = jnp.where(visible, logits_BKGTS, MASK_VALUE)
  peak = jax.lax.stop_gradient(logits_BKGTS.max(axis=-1, keepdims=True))
  probs = jnp.where(visible, jnp.exp(logits_BKGTS - peak), 0.0)
  denom = probs.sum(axis=-1, keepdims=True)
  probs = probs / jnp.where(denom == 0.0, 1.0, denom)
  out_BTKGD = jnp.einsum('bkgts,bskd->btkgd', probs, v_BSKD.astype(jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)
  return out_BTKGD.reshape(q_BTHD.shape).astype(q_BTHD.dtype)


def blocked_train_attention(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array,
                            mask: masks_lib.DFlashTrainMask, anchors_BN,
                            scale: float | None = None) -> jax.Array:
  """``DFlashTrainMask`` attention computed block by block, the XLA form of its sparsity.

  Each of the N blocks' B queries scores the S context keys and its own B keys only, so
  the logits are ``[N·B, S + B]`` per head instead of the dense ``[N·B, S + N·B]``; with
  N = 128 anchors of B = 16 over S = 320 that is ~7x fewer. Same values and gradients as
  ``reference_attention`` with the same mask (fp32 softmax; fully masked rows are 0).
  """
  batch, q_len, num_heads, head_dim = q_BTHD.shape
  mask = mask.resolve(q_len, k_BSKD.shape[1])
  anchors_BN = mask.prepare_offsets(anchors_BN, batch, q_len)
  s, big_b = mask.context_len, mask.block_size
  n = q_len // big_b
  num_kv_heads = k_BSKD.shape[2]
  groups = num_heads // num_kv_heads
  scale = head_dim**-0.5 if scale is None else scale
  q_BNQKGD = q_BTHD.reshape(batch, n, big_b, num_kv_heads, groups, head_dim)
  k_ctx, v_ctx = k_BSKD[:, :s], v_BSKD[:, :s].astype(jnp.float32)
  k_blk = k_BSKD[:, s:].reshape(batch, n, big_b, num_kv_heads, head_dim)
  v_blk = v_BSKD[:, s:].reshape(batch, n, big_b, num_kv_heads, head_dim).astype(jnp.float32)
  einsum = functools.partial(jnp.einsum, preferred_element_type=jnp.float32,
                             precision=jax.lax.Precision.HIGHEST)
  ctx_BNKGQS = einsum('bnqkgd,bskd->bnkgqs', q_BNQKGD, k_ctx) * scale
  own_BNKGQP = einsum('bnqkgd,bnpkd->bnkgqp', q_BNQKGD, k_blk) * scale
  kv_S = jnp.arange(s, dtype=jnp.int32)
  anchor_BN1 = anchors_BN[..., None]
  ctx_visible_BNS = (kv_S < anchor_BN1) & (anchor_BN1 >= 0)
  if mask.window is not None:
    ctx_visible_BNS &= kv_S > anchor_BN1 - mask.window
  ctx_visible = ctx_visible_BNS[:, :, None, None, None, :]
  own_visible = (anchors_BN >= 0)[:, :, None, None, None, None]
  ctx_BNKGQS = jnp.where(ctx_visible, ctx_BNKGQS, MASK_VALUE)
  own_BNKGQP = jnp.where(own_visible, own_BNKGQP, MASK_VALUE)
  peak = jax.lax.stop_gradient(jnp.maximum(ctx_BNKGQS.max(axis=-1, keepdims=True),
                                           own_BNKGQP.max(axis=-1, keepdims=True)))
  p_ctx = jnp.where(ctx_visible, jnp.exp(ctx_BNKGQS - peak), 0.0)
  p_own = jnp.where(own_visible, jnp.exp(own_BNKGQP - peak), 0.0)
  denom = p_ctx.sum(axis=-1, keepdims=True) + p_own.sum(axis=-1, keepdims=True)
  denom = jnp.where(denom == 0.0, 1.0, denom)
  out_BNQKGD = (einsum('bnkgqs,bskd->bnqkgd', p_ctx / denom, v_ctx)
                + einsum('bnkgqp,bnpkd->bnqkgd', p_own / denom, v_blk))
  return out_BNQKGD.reshape(q_BTHD.shape).astype(q_BTHD.dtype)
