"""AdamW with a learning-rate schedule and global-norm clipping (optax).

Schedules (`cfg.schedule`):
  cosine  linear warmup, then cosine decay to 10% of the peak at `num_steps`;
  wsd     warmup-stable-decay: linear warmup, constant peak, then a linear decay to 10% over
          the last `decay_ratio` of `num_steps`. Steps before the decay do not depend on
          `num_steps`, so a long run can be extended (a larger `num_steps`) and resumed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def make_schedule(cfg) -> optax.Schedule:
  """cfg: learning_rate, warmup_ratio, num_steps; schedule and decay_ratio (optional)."""
  warmup = max(1, int(cfg.warmup_ratio * cfg.num_steps))
  kind = cfg.get('schedule', 'cosine')
  if kind == 'cosine':
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=warmup,
        decay_steps=max(cfg.num_steps, warmup + 1), end_value=cfg.learning_rate * 0.1)
  if kind == 'wsd':
    decay = max(1, int(cfg.decay_ratio * cfg.num_steps))
    decay_start = max(warmup, cfg.num_steps - decay)

    def wsd(count):
      step = jnp.asarray(count, jnp.float32)
      ramp = jnp.minimum(1.0, (step + 1) / warmup)
      tail = jnp.clip((step - decay_start) / decay, 0.0, 1.0)
      return cfg.learning_rate * ramp * (1.0 - 0.9 * tail)
    return wsd
  raise ValueError(f"training.schedule must be 'cosine' or 'wsd', got {kind!r}")


def make_optimizer(cfg) -> optax.GradientTransformation:
  """cfg: learning_rate, warmup_ratio, num_steps, weight_decay, grad_clip, b1, b2."""
  return optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))


def set_step(opt_state, step: int):
  """`opt_state` with every step counter set to `step` (moments untouched): the schedule
  and bias correction continue from `step` after a warm restart from exported params."""
  def set_count(path, leaf):
    name = getattr(path[-1], 'name', None) if path else None
    return jnp.full_like(leaf, step) if name == 'count' else leaf
  return jax.tree_util.tree_map_with_path(set_count, opt_state)
