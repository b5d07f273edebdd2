"""MTP objectives: joint pretraining with the target, and post-hoc on a frozen target.

  mtp_joint    target + MTP trained together on the `target_lm` corpora:
               L = L_main + λ(step) Σ_k w_k L_k, gradients flow into the trunk; with β = 1,
               w_k = 1/D, i.e. DeepSeek-V3's L_main + (λ/D) Σ_k L_k. λ is a step schedule
               (`training.mtp_lambda_schedule`: (fraction of num_steps, λ) pairs).
  mtp_posthoc  MTP alone on a frozen target's self-distilled data (FastMTP): L = Σ_k w_k L_k
               with CE only where the label is target-written (loss_mask).

Per-depth weights w_k = β^{k-1} / Σ_j β^{j-1} (`training.mtp_beta`; FastMTP uses 0.6).
Depth k at position i reads t_{i+k} and predicts t_{i+k+1} (`MTP.__call__`).

A reduced draft vocabulary (`mtp.draft_vocab_size` > 0, post-hoc only; FastMTP's
vocabulary compression) is the `draft_vocab_size` tokens the target writes most often in
the distilled data (`draft_vocab.frequent_tokens`, as DFlash and EAGLE-3 choose theirs);
the depths then score only those rows of the shared head, and CE covers the labels inside
the subset.

Logged per depth k: `loss_d{k}` and `agree_d{k}`, the top-1 agreement with the target:
the fraction of supervised positions i where the depth-k argmax at i equals the target's
own argmax for t_{i+k+1} given the true prefix t_0..t_{i+k}. On greedy self-distilled
data (where the true prefix is the target's greedy output) this is the depth-k greedy
acceptance conditional on the earlier drafts being accepted.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspec import checkpoint
from dspec.models.draft_vocab import frequent_tokens
from dspec.models.mtp import MTP, MTPConfig, save_mtp, shifted
from dspec.training.distill import split_distilled
from dspec.training.losses import masked_mean, token_cross_entropy
from dspec.training import slot_acceptance
from dspec.training.trainer import TrainTask


class JointModel(nnx.Module):
  """Target and MTP trained together (the MTP borrows the target's embedding and head)."""

  def __init__(self, target, mtp: MTP):
    self.target = target
    self.mtp = mtp


def depth_weights(num_depths: int, beta: float):
  w = beta ** np.arange(num_depths, dtype=np.float64)
  return jnp.asarray(w / w.sum(), jnp.float32)


def lambda_at(schedule, step: int, num_steps: int) -> float:
  """λ of the last (fraction, λ) entry whose fraction * num_steps <= step."""
  lam = 0.0
  for frac, value in sorted(schedule):
    if step >= frac * num_steps:
      lam = value
  return float(lam)


def mtp_sums(mtp: MTP, target, target_out, tokens_BS, label_mask_BS) -> dict:
  """Per-depth sums [D] of CE, agreement and supervised count (ce_count: the supervised
  labels inside the draft vocabulary, over which CE is summed).

  target_out: the target's forward over tokens_BS[:, :-1] (with logits and the MTP's taps);
  label_mask_BS: which tokens may serve as labels.
  """
  h0_BTD = mtp.h0(target_out)
  t = h0_BTD.shape[1]
  target_argmax_BT = jnp.argmax(target_out.logits_BTV, axis=-1)
  ce, ce_count, agree, count = [], [], [], []
  leading_BT = jnp.ones((tokens_BS.shape[0], t), jnp.float32)   # depths 1..k all hit
  run_BT = jnp.zeros_like(leading_BT)
  for k, hidden_BTD in enumerate(mtp(target, h0_BTD, tokens_BS), start=1):
    logits_BTV = mtp.logits(target, k, hidden_BTD)
    w_BT = shifted(label_mask_BS, k + 1, t).astype(jnp.float32)
    idx_BT = mtp.draft_index(shifted(tokens_BS, k + 1, t))
    in_vocab_BT = w_BT * (idx_BT >= 0)
    ce.append(jnp.sum(token_cross_entropy(logits_BTV, jnp.maximum(idx_BT, 0)) * in_vocab_BT))
    ce_count.append(jnp.sum(in_vocab_BT))
    hit_BT = mtp.token_ids(jnp.argmax(logits_BTV, axis=-1)) == shifted(target_argmax_BT, k, t)
    agree.append(jnp.sum(hit_BT * w_BT))
    count.append(jnp.sum(w_BT))
    leading_BT = leading_BT * hit_BT
    run_BT = run_BT + leading_BT
  # w_BT is now the deepest depth's mask: positions where every depth is supervised.
  return {'ce': jnp.stack(ce), 'ce_count': jnp.stack(ce_count), 'agree': jnp.stack(agree),
          'count': jnp.stack(count), 'run': jnp.sum(run_BT * w_BT)}


def depth_metrics(sums: dict) -> dict:
  """loss_d{k}, agree_d{k} and tau_est from (summed) `mtp_sums`.

  tau_est = 1 + the mean number of leading depths that agree with the target, over
  positions where every depth is supervised: the greedy τ of a D-token MTP draft.
  """
  count = jnp.maximum(sums['count'], 1.0)
  out = {'tau_est': 1.0 + sums['run'] / count[-1]}
  ce_count = jnp.maximum(sums['ce_count'], 1.0)
  for k in range(sums['ce'].shape[0]):
    out[f'loss_d{k + 1}'] = sums['ce'][k] / ce_count[k]
    out[f'agree_d{k + 1}'] = sums['agree'][k] / count[k]
  return out


def _depth_losses(sums: dict):
  return sums['ce'] / jnp.maximum(sums['ce_count'], 1.0)


def joint_loss(model: JointModel, frozen, batch, key, *, weights):
  del frozen, key
  tokens_BS = batch['tokens']
  out = model.target(tokens_BS[:, :-1], taps=model.mtp.cfg.taps(model.target.cfg))
  ce_main = token_cross_entropy(out.logits_BTV, tokens_BS[:, 1:])
  loss_main = masked_mean(ce_main, jnp.ones_like(ce_main))
  sums = mtp_sums(model.mtp, model.target, out, tokens_BS, jnp.ones_like(tokens_BS, bool))
  loss_mtp = jnp.sum(weights * _depth_losses(sums))
  lam = batch['mtp_lambda']
  return loss_main + lam * loss_mtp, dict(depth_metrics(sums), loss_main=loss_main,
                                          loss_mtp=loss_mtp, mtp_lambda=lam)


def posthoc_loss(mtp: MTP, target, batch, key, *, weights):
  del key
  tokens_BS = batch['tokens']
  out = target(tokens_BS[:, :-1], taps=mtp.cfg.taps(target.cfg))
  sums = mtp_sums(mtp, target, out, tokens_BS, batch['loss_mask'])
  return jnp.sum(weights * _depth_losses(sums)), depth_metrics(sums)


def _evaluator(chunks):
  """evaluate(model, frozen) over held-out [tokens, label_mask] chunks."""

  @jax.jit
  def sums_of(mtp, target, tokens_BS, mask_BS):
    out = target(tokens_BS[:, :-1], taps=mtp.cfg.taps(target.cfg))
    return mtp_sums(mtp, target, out, tokens_BS, mask_BS)

  def evaluate(mtp, target) -> dict:
    total = None
    for tokens_BS, mask_BS in chunks:
      sums = sums_of(mtp, target, tokens_BS, mask_BS)
      total = sums if total is None else jax.tree.map(jnp.add, total, sums)
    return {k: float(v) for k, v in depth_metrics(total).items()}

  return evaluate


def _chunks(tokens, mask, batch_size: int):
  """Fixed-size held-out chunks (the last one padded with unsupervised rows)."""
  out = []
  for i in range(0, len(tokens), batch_size):
    t, m = tokens[i:i + batch_size], mask[i:i + batch_size]
    short = batch_size - len(t)
    out.append((np.pad(t, ((0, short), (0, 0))), np.pad(m, ((0, short), (0, 0)))))
  return out


def corpus_evaluator(cfg, workdir: str, vocab_size: int):
  """evaluate(mtp, target) -> `corpus/` per-depth metrics on the held-out windows of the
  training corpora (`training.mixture`): agreement with the target's own argmax along real
  text. Joint and post-hoc MTPs are compared on it (each with its own target)."""
  from dspec.tokenizer import load_tokenizer
  from dspec.training import target_lm
  tcfg = cfg.training
  tokenizer = load_tokenizer(cfg.model.tokenizer_dir or None, vocab_size)
  heldout = target_lm.packed_windows(cfg, tokenizer, 'heldout',
                                     os.path.join(workdir, 'data'))
  rows = np.concatenate([w[:tcfg.eval_windows] for w in heldout.values()])
  evaluate = _evaluator(_chunks(rows, np.ones_like(rows, bool), tcfg.batch_size))
  return lambda mtp, target: {f'corpus/{k}': v for k, v in evaluate(mtp, target).items()}


def mtp_config(cfg) -> MTPConfig:
  """The config's `mtp` section as an MTPConfig (draft_vocab_size is a training knob)."""
  fields = dict(cfg.mtp.items())
  fields.pop('draft_vocab_size', None)
  return MTPConfig.from_dict(fields)


# ------------------------------------------------------------------------------- tasks


def build_joint_task(cfg, workdir: str) -> TrainTask:
  """'mtp_joint': a fresh target (as `target_lm`) plus D MTP depths, trained together."""
  from dspec.training import target_lm
  tcfg = cfg.training
  if cfg.mtp.get('draft_vocab_size'):
    raise ValueError('mtp.draft_vocab_size needs training.task=mtp_posthoc (the draft '
                     'vocabulary comes from distilled token counts)')
  base = target_lm.build_task(cfg, workdir)
  target = base.model
  model = JointModel(target, MTP(mtp_config(cfg), target.cfg,
                                 rngs=nnx.Rngs(tcfg.seed + 1)))
  weights = depth_weights(model.mtp.cfg.num_depths, tcfg.mtp_beta)
  schedule = [tuple(p) for p in tcfg.mtp_lambda_schedule]

  def get_batch(step: int) -> dict:
    batch = base.get_batch(step)
    batch['mtp_lambda'] = np.float32(lambda_at(schedule, step, tcfg.num_steps))
    return batch

  mtp_eval = corpus_evaluator(cfg, workdir, target.cfg.vocab_size)

  def evaluate(model, frozen) -> dict:
    return dict(base.evaluate(model.target, frozen), **mtp_eval(model.mtp, model.target))

  def export(model, path, step):
    os.makedirs(path, exist_ok=True)
    base.export(model.target, os.path.join(path, 'target'), step)
    save_mtp(os.path.join(path, 'mtp'), model.mtp, storage_dtype=tcfg.storage_dtype,
             force=True, extra={'train_step': step})

  return TrainTask(model=model, frozen=None,
                   loss_fn=functools.partial(joint_loss, weights=weights),
                   get_batch=get_batch, evaluate=evaluate, export=export)


def posthoc_task(target, mtp_cfg: MTPConfig, data: dict, tcfg,
                 heldout_fraction: float, name: str = 'distilled data',
                 draft_vocab_size: int = 0, model_cfg=None) -> TrainTask:
  """'mtp_posthoc' on `data` (`load_distilled` format) for the frozen `target`; with
  draft_vocab_size > 0 the depths score the most target-written tokens of the training
  rows only. With the target's config section `model_cfg` the exports record the
  target (`checkpoint.target_record`)."""
  rows = split_distilled(data, tcfg.seq_len + 1, heldout_fraction, tcfg.eval_windows, name)
  vocab = target.cfg.vocab_size
  if draft_vocab_size:
    train = rows.train_rows
    mtp_cfg = dataclasses.replace(mtp_cfg, draft_vocab=frequent_tokens(
        rows.tokens[train], rows.loss_mask[train], draft_vocab_size, vocab,
        'mtp.draft_vocab_size'))
  mtp = MTP(mtp_cfg, target.cfg, rngs=nnx.Rngs(tcfg.seed))
  weights = depth_weights(mtp_cfg.num_depths, tcfg.mtp_beta)
  on_chunks = _evaluator(_chunks(rows.held_tokens, rows.held_mask, tcfg.batch_size))

  def evaluate(mtp, target) -> dict:
    return {**on_chunks(mtp, target),
            **slot_acceptance.walk_metrics(mtp, target, rows.held_tokens, rows.held_mask)}

  def get_batch(step: int) -> dict:
    return rows.batch(step, tcfg.seed, tcfg.batch_size)

  trained_on = checkpoint.target_record(target, model_cfg) if model_cfg else {}

  def export(model, path, step):
    save_mtp(path, model, storage_dtype=tcfg.storage_dtype, force=True,
             extra={'train_step': step, **trained_on})

  return TrainTask(model=mtp, frozen=target,
                   loss_fn=functools.partial(posthoc_loss, weights=weights),
                   get_batch=get_batch, evaluate=evaluate, export=export)


def build_posthoc_task(cfg, workdir: str) -> TrainTask:
  """'mtp_posthoc' from a config: the frozen target `cfg.model`, data at `cfg.data.path`;
  with `training.corpus_eval` also the `corpus/` metrics (as the joint task logs)."""
  from dspec.loading import build_target
  from dspec.training.distill import load_distilled
  target, _, _ = build_target(cfg.model)
  data = load_distilled(cfg.data.path, target.cfg.vocab_size)
  task = posthoc_task(target, mtp_config(cfg), data, cfg.training,
                      cfg.data.heldout_fraction, cfg.data.path,
                      cfg.mtp.get('draft_vocab_size', 0), cfg.model)
  if cfg.training.get('corpus_eval'):
    on_corpus = corpus_evaluator(cfg, workdir, target.cfg.vocab_size)
    on_distilled = task.evaluate
    task.evaluate = lambda mtp, target: dict(on_distilled(mtp, target),
                                             **on_corpus(mtp, target))
  return task
