"""Building blocks shared by the target and the drafters: norm, RoPE, attention, MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dspec.models.config import TransformerConfig

_INIT = nnx.initializers.normal(stddev=0.02)


class RMSNorm(nnx.Module):
  """RMSNorm computed in fp32, as in HF Llama/Qwen3 (`weight * x / rms(x)`)."""

  def __init__(self, dim: int, *, eps: float, param_dtype=jnp.float32):
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (self.weight[...].astype(jnp.float32) * x32).astype(x.dtype)


def rope_tables(positions_BT, head_dim: int, theta: float):
  """Returns (sin, cos) of shape [B, T, head_dim // 2] for absolute positions."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles_BTF = positions_BT.astype(jnp.float32)[..., None] * inv_freq
  return jnp.sin(angles_BTF), jnp.cos(angles_BTF)


def apply_rope(x_BTHD, sin_BTF, cos_BTF):
  """Rotates the two halves of the head dim (HF `rotate_half` convention)."""
  x1, x2 = jnp.split(x_BTHD.astype(jnp.float32), 2, axis=-1)
  sin, cos = sin_BTF[:, :, None, :], cos_BTF[:, :, None, :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTHD.dtype)


def attend(q_BTHD, k_BSKD, v_BSKD, mask_BTS, diagonal=None):
  """Softmax attention with GQA; fully masked rows give zeros.

  `diagonal` = (k_BTJKD, v_BTJKD): J extra keys per query, query t seeing only its own row
  t of each (EAGLE-3's training-time test: the earlier steps' keys at the same index), in
  the same softmax; J·T scores instead of J·T² for the equivalent eye-masked key blocks.
  """
  b, t, h, d = q_BTHD.shape
  kv_heads = k_BSKD.shape[2]
  q_BTKGD = q_BTHD.reshape(b, t, kv_heads, h // kv_heads, d)
  scores = jnp.einsum('btkgd,bskd->bkgts', q_BTKGD, k_BSKD,
                      preferred_element_type=jnp.float32) * (d ** -0.5)
  mask = mask_BTS[:, None, None, :, :]
  scores = jnp.where(mask, scores, -1e30)
  s = scores.shape[-1]
  if diagonal is not None:
    k_BTJKD, v_BTJKD = diagonal
    diag = jnp.einsum('btkgd,btjkd->bkgtj', q_BTKGD, k_BTJKD,
                      preferred_element_type=jnp.float32) * (d ** -0.5)
    scores = jnp.concatenate([scores, diag], axis=-1)
  probs = jax.nn.softmax(scores, axis=-1)
  probs_main = jnp.where(mask, probs[..., :s], 0.0).astype(v_BSKD.dtype)
  out = jnp.einsum('bkgts,bskd->btkgd', probs_main, v_BSKD,
                   preferred_element_type=jnp.float32)
  if diagonal is not None:
    out = out + jnp.einsum('bkgtj,btjkd->btkgd', probs[..., s:].astype(v_BTJKD.dtype),
                           v_BTJKD, preferred_element_type=jnp.float32)
  return out.reshape(b, t, h, d).astype(q_BTHD.dtype)


def _linear(d_in, d_out, cfg: TransformerConfig, rngs):
  return nnx.Linear(d_in, d_out, use_bias=False, kernel_init=_INIT,
                    dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                    rngs=rngs)


class Attention(nnx.Module):
  """GQA self-attention with RoPE and optional per-head q/k RMSNorm (Qwen3)."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, h, k, hd = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.q_proj = _linear(d, h * hd, cfg, rngs)
    self.k_proj = _linear(d, k * hd, cfg, rngs)
    self.v_proj = _linear(d, k * hd, cfg, rngs)
    self.o_proj = _linear(h * hd, d, cfg, rngs)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(hd, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
      self.k_norm = RMSNorm(hd, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)

  def project_q(self, x_BTD, sin, cos):
    b, t, _ = x_BTD.shape
    q = self.q_proj(x_BTD).reshape(b, t, self.cfg.num_heads, self.cfg.head_dim)
    if self.cfg.qk_norm:
      q = self.q_norm(q)
    return apply_rope(q, sin, cos)

  def project_kv(self, x_BTD, sin, cos):
    """Keys (normed, rotated) and values for the given inputs."""
    b, t, _ = x_BTD.shape
    k = self.k_proj(x_BTD).reshape(b, t, self.cfg.num_kv_heads, self.cfg.head_dim)
    v = self.v_proj(x_BTD).reshape(b, t, self.cfg.num_kv_heads, self.cfg.head_dim)
    if self.cfg.qk_norm:
      k = self.k_norm(k)
    return apply_rope(k, sin, cos), v

  def output(self, attn_BTHD):
    b, t = attn_BTHD.shape[:2]
    return self.o_proj(attn_BTHD.reshape(b, t, -1))


class MLP(nnx.Module):
  """SwiGLU feed-forward."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.gate_proj = _linear(cfg.embed_dim, cfg.mlp_dim, cfg, rngs)
    self.up_proj = _linear(cfg.embed_dim, cfg.mlp_dim, cfg, rngs)
    self.down_proj = _linear(cfg.mlp_dim, cfg.embed_dim, cfg, rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
  """Pre-norm decoder block. `kv_fn` decides where keys/values come from."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(cfg.embed_dim, eps=cfg.norm_eps,
                                   param_dtype=cfg.param_dtype)
    self.self_attn = Attention(cfg, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(cfg.embed_dim, eps=cfg.norm_eps,
                                            param_dtype=cfg.param_dtype)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x_BTD, sin, cos, kv_fn):
    """kv_fn(k_BTKD, v_BTKD) -> (k_all, v_all, mask_BTS[, diagonal]), the keys and values
    merged with a cache or context: the arguments of `attend` after q."""
    h = self.input_layernorm(x_BTD)
    q = self.self_attn.project_q(h, sin, cos)
    k, v = self.self_attn.project_kv(h, sin, cos)
    x_BTD = x_BTD + self.self_attn.output(attend(q, *kv_fn(k, v)))
    return x_BTD + self.mlp(self.post_attention_layernorm(x_BTD))
