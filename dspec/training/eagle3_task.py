"""EAGLE-3 objective on self-distilled data (training.task = eagle3).

Training-time test (`Eagle3Model.ttt_logits`, EAGLE-3 arXiv 2503.01840): k steps
over every position; step s at index t reads x_{t+1+s} and its own step s-1 output (step 0:
the fused frozen target taps at t) and predicts x_{t+2+s}. Loss = Σ_s decay^s · CE_s, CE_s
the mean over indices whose label is target-written (loss_mask), in the data and in the
draft vocabulary. With `soft_targets` the label is the target's own distribution at
t+1+s restricted to the draft vocabulary (EAGLE-3's soft CE) instead of the written token.

The reduced draft vocabulary is the `draft_vocab_size` tokens the target writes most often
in the distilled data (`draft_vocab.frequent_tokens`); the head starts as the target's
rows of those tokens and is trained with the rest. The target is frozen (stop_gradient).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspec import checkpoint
from dspec.models.eagle3 import (Eagle3Config, Eagle3Model, default_target_layer_ids,
                                 save_eagle3)
from dspec.models.draft_vocab import frequent_tokens
from dspec.models.mtp import shifted
from dspec.training.distill import fit_rows, split_distilled
from dspec.training.losses import token_cross_entropy
from dspec.training import slot_acceptance
from dspec.training.trainer import TrainTask


def eagle3_sums(model: Eagle3Model, target, tokens_BS, loss_mask_BS, steps: int,
                decay: float, soft_targets: bool = False) -> dict:
  """Sums from which the loss, per-step accuracy and the greedy τ estimate are ratios."""
  b, s = tokens_BS.shape
  out = target(tokens_BS, taps=model.cfg.target_layer_ids, compute_logits=soft_targets)
  taps = jax.lax.stop_gradient(out.taps_BTND)
  logits = model.ttt_logits(target, model.fuse(taps, target), tokens_BS, steps)
  vocab_ids = jnp.asarray(model.cfg.draft_vocab, jnp.int32) if model.cfg.draft_vocab else None
  sums, run_BT, alive_BT = {'loss': jnp.float32(0.0)}, jnp.zeros((b, s), jnp.int32), None
  for step, logits_BTV in enumerate(logits):
    labels_BT = shifted(tokens_BS, 2 + step, s)
    idx_BT = model.draft_index(labels_BT)
    valid_BT = shifted(loss_mask_BS, 2 + step, s).astype(bool)
    weight_BT = (valid_BT & (idx_BT >= 0)).astype(jnp.float32)
    if soft_targets:
      ref_BTV = shifted(jax.lax.stop_gradient(out.logits_BTV), 1 + step, s)
      if vocab_ids is not None:
        ref_BTV = jnp.take(ref_BTV, vocab_ids, axis=-1)
      ce_BT = -jnp.sum(jax.nn.softmax(ref_BTV, axis=-1) *
                       jax.nn.log_softmax(logits_BTV, axis=-1), axis=-1)
    else:
      ce_BT = token_cross_entropy(logits_BTV, jnp.maximum(idx_BT, 0))
    ce = jnp.sum(ce_BT * weight_BT) / jnp.maximum(jnp.sum(weight_BT), 1.0)
    sums['loss'] = sums['loss'] + decay ** step * ce
    hit_BT = (jnp.argmax(logits_BTV, axis=-1) == idx_BT) & valid_BT
    sums[f'hit{step}'] = jnp.sum(hit_BT)
    sums[f'valid{step}'] = jnp.sum(valid_BT)
    alive_BT = hit_BT if alive_BT is None else alive_BT & hit_BT
    run_BT = run_BT + alive_BT
    if step == 0:
      sums['starts'] = jnp.sum(valid_BT)
  sums['run'] = jnp.sum(run_BT)
  return sums


def eagle3_metrics(sums: dict, steps: int, batches: int = 1) -> dict:
  """loss, acc{s} (step-s top-1, teacher-forced tokens, own hidden) and tau_est
  (1 + mean leading run of correct steps from each supervised start)."""
  m = {'loss': sums['loss'] / batches,
       'tau_est': 1.0 + sums['run'] / jnp.maximum(sums['starts'], 1)}
  for step in range(steps):
    m[f'acc{step}'] = sums[f'hit{step}'] / jnp.maximum(sums[f'valid{step}'], 1)
  return m


def eagle3_loss(model, target, batch, key, *, steps: int, decay: float,
                soft_targets: bool = False):
  del key
  sums = eagle3_sums(model, target, batch['tokens'], batch['loss_mask'], steps, decay,
                     soft_targets)
  m = eagle3_metrics(sums, steps)
  return m.pop('loss'), m


def build_model(cfg, target, draft_vocab=()) -> Eagle3Model:
  """A fresh EAGLE-3 for the config's `eagle3` section, head copied from the target."""
  e = cfg.eagle3
  taps = tuple(e.target_layer_ids) or default_target_layer_ids(target.cfg.num_layers)
  ecfg = Eagle3Config(target_layer_ids=taps, num_layers=e.num_layers,
                      draft_vocab=tuple(draft_vocab), ttt_steps=e.ttt_steps,
                      norm_before_residual=e.norm_before_residual,
                      norm_before_fc=e.norm_before_fc, fc_norm=e.fc_norm,
                      norm_output=e.norm_output)
  model = Eagle3Model(ecfg, target.cfg, rngs=nnx.Rngs(cfg.training.seed))
  model.init_head_from(target)
  return model


def build_task(cfg, workdir: str) -> TrainTask:
  """The 'eagle3' task: an EAGLE-3 on `cfg.data.path` for the target `cfg.model`."""
  del workdir
  from dspec.loading import build_target
  from dspec.training.distill import load_distilled
  tcfg = cfg.training
  target, _, _ = build_target(cfg.model)
  data = load_distilled(cfg.data.path, target.cfg.vocab_size)
  return make_task(cfg, target, fit_rows(data['tokens'].astype(np.int32), tcfg.seq_len),
                   fit_rows(data['loss_mask'].astype(bool), tcfg.seq_len))


def make_task(cfg, target, tokens, loss_mask) -> TrainTask:
  """The task over token rows [N, S] with their loss masks (target-written tokens)."""
  tcfg, e = cfg.training, cfg.eagle3
  rows = split_distilled({'tokens': tokens, 'loss_mask': loss_mask}, tokens.shape[1],
                         cfg.data.heldout_fraction, tcfg.eval_windows, cfg.data.path)
  draft_vocab = ()
  if e.draft_vocab_size:
    draft_vocab = frequent_tokens(tokens[rows.train_rows], loss_mask[rows.train_rows],
                                  e.draft_vocab_size, target.cfg.vocab_size,
                                  'eagle3.draft_vocab_size')
  model = build_model(cfg, target, draft_vocab)
  held_tokens, held_mask = rows.held_tokens, rows.held_mask
  steps, decay = e.ttt_steps, e.loss_decay

  def get_batch(step: int) -> dict:
    return rows.batch(step, tcfg.seed, tcfg.batch_size)

  @jax.jit
  def eval_sums(model, target, tokens_BS, loss_mask_BS):
    return eagle3_sums(model, target, tokens_BS, loss_mask_BS, steps, decay,
                       e.soft_targets)

  def evaluate(model, target) -> dict:
    total, bs, batches = None, tcfg.batch_size, 0
    for i in range(0, len(held_tokens), bs):
      chunk_t, chunk_m = held_tokens[i:i + bs], held_mask[i:i + bs]
      short = bs - len(chunk_t)
      sums = eval_sums(model, target, np.pad(chunk_t, ((0, short), (0, 0))),
                       np.pad(chunk_m, ((0, short), (0, 0))))
      total = sums if total is None else jax.tree.map(jnp.add, total, sums)
      batches += 1
    return {**{k: float(v) for k, v in eagle3_metrics(total, steps, batches).items()},
            **slot_acceptance.walk_metrics(model, target, held_tokens, held_mask)}

  def loss_fn(model, target, batch, key):
    return eagle3_loss(model, target, batch, key, steps=steps, decay=decay,
                       soft_targets=e.soft_targets)

  trained_on = checkpoint.target_record(target, cfg.model)

  def export(model, path, step):
    save_eagle3(path, model, storage_dtype=tcfg.storage_dtype, force=True,
                extra={'train_step': step, **trained_on})

  return TrainTask(model=model, frozen=target, loss_fn=loss_fn, get_batch=get_batch,
                   evaluate=evaluate, export=export)
