"""DSpark drafter objective on self-distilled data (training.task = dspark).

Blocks as DFlash's (`dflash_task`: N random anchors a per sequence with loss_mask[a+1], and
loss_mask[a] too when `anchor_supervised`; block queries see fused target features strictly
before a and their own block). Anchor-first (`sample_from_anchor`): draft slot k = 0..B−1
is block slot k and predicts the token at a+k+1; in DFlash's layout draft slot k is block
slot k+1 (k < B−1), predicting the same token. The Markov head is teacher-forced with the
data's token at a+k.

Per slot, with p = the draft's (Markov-biased) distribution and p* = the target's at a+k:

  loss_k = ce_weight · CE(p, x_{a+k+1}) + tv_weight · TV(p, p*)
           + confidence_weight · BCE(c_k, α_k),     α_k = 1 − TV(p, p*) (no gradient)

TV = ½‖p − p*‖₁ and α_k is the acceptance probability of slot k under rejection sampling.
Weights exp(−k/γ) × valid (label in bounds, target-written, block valid), normalised by
their sum; defaults 0.1 / 0.9 / 1.0 (SpecForge `draft/dspark.py`).

The target's distributions are computed in the training step, not stored in the shards:
the step already runs the frozen target over the sequence for its tapped features, so p*
costs only the head over the labelled rows, is exact (top-k shards would truncate both
TV and α, the confidence target), and the shards stay target-agnostic and small.

Calibration (`fit_calibration`): on held-out blocks (first half) each slot's temperature
T_k is fitted in turn (sequential temperature scaling) so that the calibrated prefix
survival Ŝ_k = Ŝ_{k−1} · σ(z_k / T_k) minimises the BCE to the expected survival
S_k = Π_{j≤k} α_j (sampled acceptance; `confidence_temperatures`) and, separately, to
the greedy survival Π_{j≤k} 1[draft argmax_j = target argmax_j]
(`greedy_confidence_temperatures`, used at T = 0); both are stored with the exported
checkpoint, and the expected calibration error (ECE, 10 bins, over all valid (block, slot)
pairs) of Ŝ before and after is measured on the other half.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dspec import checkpoint
from dspec.models.dflash import save_dflash
from dspec.models.dspark import DSparkConfig, DSparkModel
from dspec.training.dflash_task import loss_gamma, sample_anchors
from dspec.training.losses import token_cross_entropy
from dspec.training.slot_acceptance import anchor_block_hidden, walk_metrics
from dspec.training.trainer import TrainTask

_TEMPERATURE_GRID = np.geomspace(0.05, 20.0, 161)


def dspark_terms(drafter: DSparkModel, target, tokens_BS, loss_mask_BS, anchors_BN,
                 gamma: float) -> dict:
  """Per-slot terms [B, N, K] of draft slots 0..K−1: ce, tv, alpha, bce, conf (logits),
  hit (argmax = label), agree (argmax = the target's argmax), valid, weight; block_valid
  [B, N]."""
  cfg = drafter.cfg
  big_b = cfg.num_drafts
  b, s = tokens_BS.shape
  n = anchors_BN.shape[1]
  out = target(tokens_BS, taps=cfg.target_layer_ids, compute_logits=False)
  taps_BSND = jax.lax.stop_gradient(out.taps_BTND)
  hidden_BNKD, pos_BNK = anchor_block_hidden(drafter, target, taps_BSND, tokens_BS,
                                             anchors_BN)
  if not cfg.sample_from_anchor:   # DFlash's layout: block slot 0 only carries the anchor
    hidden_BNKD, pos_BNK = hidden_BNKD[:, :, 1:], pos_BNK[:, :, :-1]
  hidden_BQD = hidden_BNKD.reshape(b, n * big_b, -1)
  safe_BNK = jnp.clip(pos_BNK, 0, s - 1)
  take = lambda x_BS, p_BNK: jnp.take_along_axis(x_BS, p_BNK.reshape(b, -1), axis=1
                                                 ).reshape(p_BNK.shape)
  prev_BNK = take(tokens_BS, safe_BNK)                # the token at a+k (k = 0: the anchor)
  logits_BQV, conf_BQ = drafter.heads(target, hidden_BQD, prev_BNK.reshape(b, -1))
  logits_BNKV = logits_BQV.reshape(b, n, big_b, -1)

  # The target's distribution of the token at a+k+1: its head on its hidden at a+k.
  target_hidden_BND = jnp.take_along_axis(out.hidden_BTD, safe_BNK.reshape(b, -1, 1),
                                          axis=1)
  target_logp = jax.lax.stop_gradient(jax.nn.log_softmax(
      target.logits(target_hidden_BND).astype(jnp.float32), axis=-1)).reshape(
          logits_BNKV.shape)
  draft_logp = jax.nn.log_softmax(logits_BNKV, axis=-1)
  tv_BNK = 0.5 * jnp.sum(jnp.abs(jnp.exp(draft_logp) - jnp.exp(target_logp)), axis=-1)
  alpha_BNK = jax.lax.stop_gradient(1.0 - tv_BNK)

  label_pos_BNK = pos_BNK + 1
  safe_label = jnp.clip(label_pos_BNK, 0, s - 1)
  labels_BNK = take(tokens_BS, safe_label)
  valid_BNK = (take(loss_mask_BS, safe_label) & (label_pos_BNK < s)
               & (anchors_BN >= 0)[..., None])
  decay_K = jnp.exp(-jnp.arange(big_b, dtype=jnp.float32) / gamma)
  terms = {
      'ce': token_cross_entropy(logits_BNKV, labels_BNK),
      'tv': tv_BNK,
      'alpha': alpha_BNK,
      'hit': jnp.argmax(logits_BNKV, axis=-1) == labels_BNK,
      'agree': jnp.argmax(logits_BNKV, axis=-1) == jnp.argmax(target_logp, axis=-1),
      'valid': valid_BNK,
      'weight': decay_K * valid_BNK.astype(jnp.float32),
      'block_valid': anchors_BN >= 0,
  }
  if conf_BQ is not None:
    conf_BNK = conf_BQ.reshape(b, n, big_b)
    terms['conf'] = conf_BNK
    terms['bce'] = optax.sigmoid_binary_cross_entropy(conf_BNK, alpha_BNK)
  return terms


def dspark_sums(terms: dict) -> dict:
  """Sums from which the loss terms and the metrics are ratios."""
  valid, weight = terms['valid'], terms['weight']
  run_BN = jnp.sum(jnp.cumprod((terms['hit'] & valid).astype(jnp.int32), axis=-1), -1)
  # Expected accepted drafts per block under rejection sampling (teacher-forced prefix).
  survive_BNK = jnp.cumprod(jnp.where(valid, terms['alpha'], 0.0), axis=-1)
  block_valid = terms['block_valid']
  sums = {
      'weight': jnp.sum(weight),
      'weighted_ce': jnp.sum(terms['ce'] * weight),
      'weighted_tv': jnp.sum(terms['tv'] * weight),
      'hit1': jnp.sum(terms['hit'][..., 0] & valid[..., 0]),
      'valid1': jnp.sum(valid[..., 0]),
      'run': jnp.sum(jnp.where(block_valid, run_BN, 0)),
      'expected_run': jnp.sum(jnp.where(block_valid[..., None], survive_BNK, 0.0)),
      'blocks': jnp.sum(block_valid),
      'alpha': jnp.sum(jnp.where(valid, terms['alpha'], 0.0)),
      'valid': jnp.sum(valid),
  }
  if 'bce' in terms:
    conf = jax.nn.sigmoid(terms['conf'])
    sums.update(weighted_bce=jnp.sum(terms['bce'] * weight),
                conf_abs_err=jnp.sum(jnp.where(valid, jnp.abs(conf - terms['alpha']), 0.0)))
  return sums


def dspark_metrics(sums: dict, ce_weight: float = 0.1, tv_weight: float = 0.9,
                   confidence_weight: float = 1.0) -> dict:
  """loss and its terms, acc1 (slot-0 top-1), tau_est (1 + mean greedy leading run),
  accept_len (1 + expected accepted drafts when sampling), alpha (mean acceptance
  probability) and conf_mae (|c − α|) when the confidence head exists."""
  weight = jnp.maximum(sums['weight'], 1e-6)
  blocks = jnp.maximum(sums['blocks'], 1)
  valid = jnp.maximum(sums['valid'], 1)
  m = {
      'ce': sums['weighted_ce'] / weight,
      'tv': sums['weighted_tv'] / weight,
      'acc1': sums['hit1'] / jnp.maximum(sums['valid1'], 1),
      'tau_est': 1.0 + sums['run'] / blocks,
      'accept_len': 1.0 + sums['expected_run'] / blocks,
      'alpha': sums['alpha'] / valid,
  }
  loss = ce_weight * m['ce'] + tv_weight * m['tv']
  if 'weighted_bce' in sums:
    m.update(bce=sums['weighted_bce'] / weight, conf_mae=sums['conf_abs_err'] / valid)
    loss = loss + confidence_weight * m['bce']
  m['loss'] = loss
  return m


def dspark_loss(drafter, target, batch, key, *, num_anchors: int, gamma: float,
                anchor_supervised: bool = True, ce_weight: float = 0.1,
                tv_weight: float = 0.9, confidence_weight: float = 1.0):
  anchors_BN = sample_anchors(key, batch['loss_mask'], num_anchors, anchor_supervised)
  m = dspark_metrics(dspark_sums(dspark_terms(drafter, target, batch['tokens'],
                                              batch['loss_mask'], anchors_BN, gamma)),
                     ce_weight, tv_weight, confidence_weight)
  return m.pop('loss'), m


# ------------------------------------------------------------------------ calibration


def _bce(pred, target):
  pred = np.clip(pred, 1e-7, 1 - 1e-7)
  return -np.mean(target * np.log(pred) + (1 - target) * np.log(1 - pred))


def survival_arrays(z_MK, alpha_MK, valid_MK, temperatures=()):
  """(predicted Ŝ [M, K], expected survival S [M, K], valid prefix [M, K]) of M blocks."""
  z = np.asarray(z_MK, np.float64)
  if len(temperatures):
    z = z / np.asarray(temperatures, np.float64)
  pred = np.cumprod(1.0 / (1.0 + np.exp(-z)), axis=1)
  target = np.cumprod(np.where(valid_MK, alpha_MK, 0.0), axis=1)
  return pred, target, np.cumprod(valid_MK, axis=1).astype(bool)


def expected_calibration_error(pred, target, bins: int = 10) -> float:
  """Σ_bins (n_b / N) |mean prediction − mean target| over equal-width bins of pred."""
  pred, target = np.ravel(pred), np.ravel(target)
  if not len(pred):
    return float('nan')
  which = np.minimum((pred * bins).astype(int), bins - 1)
  err = 0.0
  for i in range(bins):
    sel = which == i
    if sel.any():
      err += sel.mean() * abs(pred[sel].mean() - target[sel].mean())
  return float(err)


def fit_calibration(z_MK, alpha_MK, valid_MK) -> tuple:
  """Per-slot temperatures T_k, fitted slot by slot on the calibrated prefix."""
  _, target, ok = survival_arrays(z_MK, alpha_MK, valid_MK)
  z = np.asarray(z_MK, np.float64)
  prefix = np.ones(z.shape[0])
  temps = []
  for k in range(z.shape[1]):
    sel = ok[:, k]
    best = temps[-1] if temps else 1.0
    if sel.any():
      losses = [_bce(prefix[sel] / (1.0 + np.exp(-z[sel, k] / t)), target[sel, k])
                for t in _TEMPERATURE_GRID]
      best = float(_TEMPERATURE_GRID[int(np.argmin(losses))])
    temps.append(best)
    prefix = prefix / (1.0 + np.exp(-z[:, k] / best))
  return tuple(temps)


def calibration_report(z_MK, alpha_MK, valid_MK) -> dict:
  """Temperatures fitted on the first half of the blocks and the ECE of Ŝ on the second
  half before and after (the whole set for both when there are fewer than 2 blocks)."""
  m = len(z_MK)
  fit, test = (slice(0, m // 2), slice(m // 2, None)) if m >= 2 else (slice(None),) * 2
  temps = fit_calibration(z_MK[fit], alpha_MK[fit], valid_MK[fit])

  def ece(t):
    pred, target, ok = survival_arrays(z_MK[test], alpha_MK[test], valid_MK[test], t)
    return expected_calibration_error(pred[ok], target[ok])

  return {'temperatures': temps, 'ece_raw': ece(()), 'ece': ece(temps)}


# ------------------------------------------------------------------------------- task


def build_drafter(cfg, target_cfg, tokenizer_mask_id=None) -> DSparkModel:
  """A freshly initialised DSpark drafter for the config's `dspark` section (Markov W2
  zero: it starts as DFlash's logits)."""
  d = cfg.dspark
  mask_id = d.mask_token_id
  if mask_id < 0:
    mask_id = target_cfg.vocab_size - 1 if tokenizer_mask_id is None else tokenizer_mask_id
  dcfg = DSparkConfig.create(
      num_target_layers=target_cfg.num_layers, num_layers=d.num_layers,
      block_size=d.block_size, mask_token_id=mask_id,
      target_layer_ids=tuple(d.target_layer_ids), sliding_window=d.sliding_window or None,
      attention_impl=d.attention_impl, layer_types=tuple(d.get('layer_types', ())),
      is_causal=d.get('is_causal'), markov_rank=d.markov_rank,
      markov_head_type=d.markov_head_type, enable_confidence_head=d.enable_confidence_head,
      confidence_head_with_markov=d.confidence_head_with_markov,
      sample_from_anchor=d.get('sample_from_anchor', True))
  return DSparkModel(dcfg, target_cfg, rngs=nnx.Rngs(cfg.training.seed))


def build_task(cfg, workdir: str) -> TrainTask:
  """The 'dspark' task: a DSpark drafter on `cfg.data.path` for the target `cfg.model`."""
  del workdir
  from dspec.loading import build_target
  from dspec.training.distill import load_distilled, split_distilled
  tcfg, d = cfg.training, cfg.dspark
  target, tokenizer, _ = build_target(cfg.model)
  data = load_distilled(cfg.data.path, target.cfg.vocab_size)
  rows = split_distilled(data, tcfg.seq_len, cfg.data.heldout_fraction, tcfg.eval_windows,
                         cfg.data.path)
  held_tokens, held_mask = rows.held_tokens, rows.held_mask
  drafter = build_drafter(cfg, target.cfg, tokenizer.mask_id)

  def get_batch(step: int) -> dict:
    return rows.batch(step, tcfg.seed, tcfg.batch_size)

  gamma = loss_gamma(drafter.cfg.num_drafts + 1, d.loss_gamma)
  weights = dict(ce_weight=d.ce_weight, tv_weight=d.tv_weight,
                 confidence_weight=d.confidence_weight)
  loss_fn = functools.partial(dspark_loss, num_anchors=d.num_anchors, gamma=gamma,
                              anchor_supervised=d.anchor_supervised, **weights)

  @jax.jit
  def eval_terms(model, target, tokens_BS, loss_mask_BS, key):
    anchors_BN = sample_anchors(key, loss_mask_BS, d.num_anchors, d.anchor_supervised)
    terms = dspark_terms(model, target, tokens_BS, loss_mask_BS, anchors_BN, gamma)
    keep = {k: terms[k] for k in ('alpha', 'agree', 'valid', 'block_valid', 'conf')
            if k in terms}
    return dspark_sums(terms), keep

  def held_out(model, target):
    """(summed metrics, per-block arrays of the valid blocks) over the held-out rows."""
    total, blocks = None, []
    bs = tcfg.batch_size
    for i in range(0, len(held_tokens), bs):
      chunk_t, chunk_m = held_tokens[i:i + bs], held_mask[i:i + bs]
      short = bs - len(chunk_t)   # pad the last chunk with unsupervised rows
      sums, keep = eval_terms(model, target, np.pad(chunk_t, ((0, short), (0, 0))),
                              np.pad(chunk_m, ((0, short), (0, 0))), jax.random.key(i))
      total = sums if total is None else jax.tree.map(jnp.add, total, sums)
      keep = jax.device_get(keep)
      ok = keep.pop('block_valid')
      blocks.append({k: v[ok] for k, v in keep.items()})
    arrays = {k: np.concatenate([blk[k] for blk in blocks]) for k in blocks[0]}
    return total, arrays

  def calibrations(arrays) -> dict:
    """{'sampled' | 'greedy': calibration_report} of the held-out blocks."""
    return {mode: calibration_report(arrays['conf'], arrays[key].astype(np.float64),
                                     arrays['valid'])
            for mode, key in (('sampled', 'alpha'), ('greedy', 'agree'))}

  def evaluate(model, target) -> dict:
    """Held-out metrics and the decode walk's τ; with the confidence head also the
    calibration errors (ECE of the sampled and the greedy prefix survival, before and
    after temperature scaling)."""
    total, arrays = held_out(model, target)
    m = {k: float(v) for k, v in dspark_metrics(total, **weights).items()}
    m.update(walk_metrics(model, target, held_tokens, held_mask))
    if 'conf' in arrays and len(arrays['conf']):
      for mode, report in calibrations(arrays).items():
        prefix = '' if mode == 'sampled' else 'greedy_'
        m.update({prefix + 'ece_raw': report['ece_raw'], prefix + 'ece': report['ece']})
    return m

  trained_on = checkpoint.target_record(target, cfg.model)

  def export(model, path, step):
    extra = {'train_step': step, **trained_on}
    if model.confidence_head is not None and d.calibrate:
      _, arrays = held_out(model, target)
      if len(arrays['conf']):
        reports = calibrations(arrays)
        model.cfg = dataclasses.replace(
            model.cfg, confidence_temperatures=reports['sampled']['temperatures'],
            greedy_confidence_temperatures=reports['greedy']['temperatures'])
        extra['calibration'] = {
            mode: {k: list(v) if isinstance(v, tuple) else v for k, v in r.items()}
            for mode, r in reports.items()}
    save_dflash(path, model, storage_dtype=tcfg.storage_dtype, force=True, extra=extra)

  return TrainTask(model=drafter, frozen=target, loss_fn=loss_fn, get_batch=get_batch,
                   evaluate=evaluate, export=export)
