"""AdamW with linear warmup + cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import optax


def make_optimizer(cfg) -> optax.GradientTransformation:
  """cfg: learning_rate, warmup_ratio, num_steps, weight_decay, grad_clip, b1, b2."""
  warmup = max(1, int(cfg.warmup_ratio * cfg.num_steps))
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=warmup,
      decay_steps=max(cfg.num_steps, warmup + 1), end_value=cfg.learning_rate * 0.1)
  return optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))
