"""Draft verification: greedy match and lossless rejection sampling.

Both return `(num_accepted_B, out_tokens_BG1)`: the first `num_accepted` entries of
`out_tokens` are the accepted drafts and entry `num_accepted` is the bonus (all drafts
accepted) or corrected (first rejection) token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspec.sampling import sample_from_probs


def _leading_true(ok_BG):
  """Length of the leading run of True per row."""
  return jnp.sum(jnp.cumprod(ok_BG.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def first_argmax(logits_NV):
  """jnp.argmax (first index of the maximum) as max + min index: XLA CPU runs argmax's
  variadic reduce several times slower. A row without a maximum (NaN) gets the last
  index instead of the NaN's."""
  vocab = logits_NV.shape[-1]
  is_max = logits_NV == jnp.max(logits_NV, axis=-1, keepdims=True)
  first = jnp.min(jnp.where(is_max, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)
  return jnp.minimum(first, vocab - 1)


def greedy_verify(draft_BG, num_proposed_B, logits_BG1V):
  """Accept while draft == target argmax; the emitted tokens are the target argmaxes."""
  g = draft_BG.shape[1]
  argmax_BG1 = first_argmax(logits_BG1V)
  ok = (draft_BG == argmax_BG1[:, :g]) & (jnp.arange(g)[None, :] < num_proposed_B[:, None])
  return _leading_true(ok), argmax_BG1


def rejection_verify(key, draft_BG, num_proposed_B, q_BGV, p_BG1V):
  """Leviathan/Chen rejection sampling on processed distributions.

  Accept draft j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection emit
  a sample of normalize(max(p_j - q_j, 0)); if all are accepted emit a bonus from p_G.
  `q_BGV=None` means the drafter proposed deterministically (one-hot q).
  """
  u_BG, q_d, key_x = _draws(key, draft_BG, q_BGV)
  g = draft_BG.shape[1]
  p_d = jnp.take_along_axis(p_BG1V[:, :g], draft_BG[..., None], axis=-1)[..., 0]
  ok = (u_BG * q_d < p_d) & (jnp.arange(g)[None, :] < num_proposed_B[:, None])
  n_B = _leading_true(ok)
  p_n = p_BG1V[jnp.arange(draft_BG.shape[0]), n_B]
  return _emit(key_x, draft_BG, num_proposed_B, q_BGV, n_B, p_n)


def rejection_verify_logits(key, draft_BG, num_proposed_B, q_BGV, logits_BG1V, probs_fn):
  """`rejection_verify` on `probs_fn(logits)` (the processed distributions), same draws and
  result. On CPU, where processing the rows costs more than the verify forward's share,
  rows are processed one position at a time and only up to every sequence's first
  rejection (plus the row each sequence emits from); elsewhere all rows at once."""
  if jax.default_backend() != 'cpu':
    return rejection_verify(key, draft_BG, num_proposed_B, q_BGV, probs_fn(logits_BG1V))
  u_BG, q_d, key_x = _draws(key, draft_BG, q_BGV)
  b, g = draft_BG.shape
  rows = jnp.arange(b)

  def step(c):
    j, n_B, live_B = c
    p_BV = probs_fn(jax.lax.dynamic_index_in_dim(logits_BG1V, j, axis=1, keepdims=False))
    p_d = p_BV[rows, draft_BG[:, j]]
    live_B &= (u_BG[:, j] * q_d[:, j] < p_d) & (j < num_proposed_B)
    return j + 1, n_B + live_B, live_B

  n_B = jnp.zeros((b,), jnp.int32)
  if g:
    n_B = jax.lax.while_loop(lambda c: (c[0] < g) & jnp.any(c[2]), step,
                             (jnp.int32(0), n_B, jnp.ones((b,), bool)))[1]
  p_n = probs_fn(logits_BG1V[rows, n_B])
  return _emit(key_x, draft_BG, num_proposed_B, q_BGV, n_B, p_n)


def _draws(key, draft_BG, q_BGV):
  """(uniforms [B, G], q of each draft [B, G], the key of the emitted sample)."""
  key_u, key_x = jax.random.split(key)
  u_BG = jax.random.uniform(key_u, draft_BG.shape, jnp.float32)
  if q_BGV is None:
    q_d = jnp.ones(draft_BG.shape, jnp.float32)
  else:
    q_d = jnp.take_along_axis(q_BGV, draft_BG[..., None], axis=-1)[..., 0]
  return u_BG, q_d, key_x


def _emit(key_x, draft_BG, num_proposed_B, q_BGV, n_B, p_n):
  """[B, G + 1]: the n accepted drafts, then the corrected or bonus token drawn from p_n
  (the processed distribution at position n, [B, V])."""
  b, g = draft_BG.shape
  rows = jnp.arange(b)
  nc = jnp.minimum(n_B, max(g - 1, 0))
  if g == 0:
    residual = p_n
  else:
    if q_BGV is None:
      q_n = jax.nn.one_hot(draft_BG[rows, nc], p_n.shape[-1], dtype=p_n.dtype)
    else:
      q_n = q_BGV[rows, nc]
    # A position that proposed nothing (n == num_proposed < g) is a plain target sample.
    rejected_here = (n_B < g) & (n_B < num_proposed_B)
    residual = jnp.where(rejected_here[:, None], jnp.maximum(p_n - q_n, 0.0), p_n)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.maximum(mass, 1e-30), p_n)
  corrected = sample_from_probs(key_x, residual)
  j = jnp.arange(g + 1)[None, :]
  padded = jnp.concatenate([draft_BG, jnp.zeros((b, 1), jnp.int32)], axis=1)
  out = jnp.where(j < n_B[:, None], padded, corrected[:, None])
  return n_B, out.astype(jnp.int32)
