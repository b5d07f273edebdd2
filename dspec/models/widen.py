"""Function-preserving MLP widening: a target with R times the MLP weights that writes the
same tokens."""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
from flax import nnx

from dspec import checkpoint
from dspec.models.transformer import Transformer

# Seed of the down-projection shares: every widening of a model gives identical weights.
SHARES_SEED = 0


def widen_mlp(model: Transformer, ratio: int) -> Transformer:
  """`model` with each SwiGLU MLP neuron copied `ratio` times (mlp_dim x ratio); its logits
  equal `model`'s up to float rounding, so it writes the same tokens (save a near-tie that
  rounding could flip).

  What for: a small target that sits in a CPU's cache decodes compute-bound, where
  speculative decoding cannot pay; widened, it streams its weights from memory per token
  like a large model, with exactly the small model's behaviour (its drafters still fit).

  Neuron j's gate and up rows are repeated; its down column is split into `ratio` random
  positive shares that sum to 1 (fixed seed), so the copies' outputs add up to the
  original's. The widened model keeps the weights fingerprint of `model` as
  `widened_from` (`checkpoint.target_fingerprint`): a drafter trained on `model` matches
  it. ratio=1 returns `model` itself; ValueError unless ratio is an integer >= 1.
  """
  if isinstance(ratio, bool) or not isinstance(ratio, numbers.Integral) or ratio < 1:
    raise ValueError(f'widen_mlp must be an integer >= 1, got {ratio!r}')
  if ratio == 1:
    return model
  cfg = dataclasses.replace(model.cfg, mlp_dim=model.cfg.mlp_dim * ratio)
  wide = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  key = jax.random.key(SHARES_SEED)
  for i, layer in params['layers'].items():
    mlp = layer['mlp']
    for name in ('gate_proj', 'up_proj'):   # kernels are [in, out]: repeat the outputs
      mlp[name]['kernel'] = jnp.repeat(mlp[name]['kernel'], ratio, axis=1)
    down_FD = mlp['down_proj']['kernel']
    shares_FR = jax.random.uniform(jax.random.fold_in(key, i), (down_FD.shape[0], ratio),
                                   minval=0.5, maxval=1.5)
    shares_FR = shares_FR / shares_FR.sum(axis=1, keepdims=True)
    down_FRD = down_FD.astype(jnp.float32)[:, None, :] * shares_FR[:, :, None]
    mlp['down_proj']['kernel'] = down_FRD.reshape(-1, down_FRD.shape[2]).astype(
        down_FD.dtype)
  state = nnx.state(wide, nnx.Param)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(wide, state)
  wide.widened_from = checkpoint.target_fingerprint(model)
  return wide
