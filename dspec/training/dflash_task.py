"""DFlash, DFlash-2 and BD3-LM drafter objectives on self-distilled data
(training.task = dflash | dflash2 | bd3lm).

DFlash (SpecForge `core/dflash.py`): N random anchors per sequence among positions a with
tokens a and a+1 both target-written (`anchor_supervised`, the reference rule) or only
a+1 (then the last prompt token, the anchor of the first round at inference, is trained
too); block [token_a, MASK×(B−1)] at positions a..a+B−1;
slot k predicts the token at a+k (same-position labels, k = 1..B−1, slot 0 has no loss);
block queries see fused target features strictly before a and their own block, never
other blocks; CE weighted by exp(−(k−1)/γ) × (in bounds) × loss_mask, normalised by the
sum of those weights.

DFlash-2 (z-lab/dflash; speculators PR #1006): the DFlash loss on the
unary logits plus α × a K-way CE of the candidate selector: the candidates of slot k are
the unary top-K (indices without gradient, their logits with it), the gold token replaces
the K-th candidate when it is missing, the predecessor is teacher-forced (the token at
a+k−1, the anchor for k = 1), and the CE gets the same per-slot weights.

BD3-LM (arXiv 2503.09573) with KV injection kept: fixed blocks of B; one
noise level t per block (antithetic, rescaled into [eps_min, eps_max]); each token masked
with probability t; the packed [x_t ; x_0] sequence where the clean half x_0 is the
injected target context (`BD3LMContextMask`: own noisy block ∪ context of earlier blocks);
(1/t)-weighted CE on masked target-written tokens, divided by the number of target-written
tokens. With `keep_first` the first token of every block stays clean, like the DFlash
anchor, so t = 1 is exactly DFlash with anchors at multiples of B and uniform weights.
SUBS's −∞ logit on MASK is not applied: both objectives share the target head.

The target is frozen: its features are computed inside the loss under stop_gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspec import checkpoint
from dspec.models.dflash import BD3LMContextMask, DFlashConfig, DFlashModel, save_dflash
from dspec.models.dflash2 import DFlash2Config, DFlash2Model
from dspec.models.draft_vocab import frequent_tokens
from dspec.training.losses import token_cross_entropy
from dspec.training.slot_acceptance import anchor_block_hidden, walk_metrics
from dspec.sampling import top_k
from dspec.training.trainer import TrainTask

# Loss decay γ of the reference per block size (SpecForge `--loss-decay-gamma`).
DEFAULT_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}


def loss_gamma(block_size: int, gamma: float = 0.0) -> float:
  """γ for exp(−(k−1)/γ): the given one, the reference value, or 1 + 0.375·B between."""
  if gamma > 0:
    return float(gamma)
  return DEFAULT_GAMMA.get(block_size, 1.0 + 0.375 * block_size)


def target_taps(target, tokens_BS, taps):
  """Frozen target features [B, S, n_taps, H] (residual outputs of the tapped layers)."""
  out = target(tokens_BS, taps=taps, compute_logits=False)
  return jax.lax.stop_gradient(out.taps_BTND)


def sample_anchors(key, loss_mask_BS, num_anchors: int, anchor_supervised: bool = True):
  """Up to N anchors per row, without replacement, among a with loss_mask[a+1] (and
  loss_mask[a] when `anchor_supervised`, the reference rule).

  Without `anchor_supervised` the last prompt token is a candidate too: it is the anchor
  of the first round at inference. Returns sorted anchors [B, N]; rows with fewer
  candidates pad with −1 (invalid blocks).
  """
  cand_BA = loss_mask_BS[:, 1:]
  if anchor_supervised:
    cand_BA = cand_BA & loss_mask_BS[:, :-1]
  n = min(num_anchors, cand_BA.shape[1])
  score_BA = jnp.where(cand_BA, jax.random.uniform(key, cand_BA.shape), -1.0)
  top_BN, idx_BN = top_k(score_BA, n)
  big = cand_BA.shape[1] + 1
  anchors_BN = jnp.sort(jnp.where(top_BN >= 0, idx_BN, big), axis=-1)
  return jnp.where(anchors_BN == big, -1, anchors_BN).astype(jnp.int32)


def dflash_terms(drafter: DFlashModel, target, taps_BSND, tokens_BS, loss_mask_BS,
                 anchors_BN, gamma: float) -> dict:
  """Per-slot terms [B, N, B−1] of slots 1..B−1: ce, hit (argmax == label), weight.

  weight = exp(−(k−1)/γ) · valid, valid = block valid & a+k in bounds & loss_mask[a+k].
  A DFlash-2 drafter adds the selector's sel_ce, sel_hit (its teacher-forced argmax is
  the gold token, which the unary top-K holds) and recall (the top-K holds the gold).
  """
  cfg = drafter.cfg
  big_b = cfg.block_size
  b, s = tokens_BS.shape
  n = anchors_BN.shape[1]
  hidden_BNKD, pos_BNK = anchor_block_hidden(drafter, target, taps_BSND, tokens_BS,
                                             anchors_BN)
  hidden_BNKD = hidden_BNKD[:, :, 1:]
  logits_BNKV = drafter.draft_logits(
      target, hidden_BNKD.reshape(b, n * (big_b - 1), -1)).reshape(b, n, big_b - 1, -1)

  label_pos_BNK = pos_BNK[:, :, 1:]
  safe_pos = jnp.clip(label_pos_BNK, 0, s - 1).reshape(b, -1)
  labels_BNK = jnp.take_along_axis(tokens_BS, safe_pos, axis=1).reshape(label_pos_BNK.shape)
  supervised_BNK = jnp.take_along_axis(loss_mask_BS, safe_pos, axis=1).reshape(
      label_pos_BNK.shape)
  valid_BNK = (supervised_BNK & (label_pos_BNK < s) & (anchors_BN >= 0)[..., None])
  decay_K = jnp.exp(-jnp.arange(big_b - 1, dtype=jnp.float32) / gamma)
  label_idx_BNK = drafter.draft_index(labels_BNK)   # −1: outside the draft vocabulary
  in_vocab_BNK = label_idx_BNK >= 0
  terms = {
      'ce': token_cross_entropy(logits_BNKV, jnp.maximum(label_idx_BNK, 0)),
      'hit': jnp.argmax(logits_BNKV, axis=-1) == label_idx_BNK,
      'valid': valid_BNK,
      'weight': decay_K * (valid_BNK & in_vocab_BNK).astype(jnp.float32),
      'block_valid': anchors_BN >= 0,
  }
  if isinstance(drafter, DFlash2Model):
    prev_pos = jnp.clip(pos_BNK[:, :, :-1], 0, s - 1).reshape(b, -1)
    prev_BNK = jnp.take_along_axis(tokens_BS, prev_pos, axis=1).reshape(labels_BNK.shape)
    terms.update(selector_terms(drafter, hidden_BNKD, logits_BNKV, labels_BNK, prev_BNK))
  return terms


def selector_terms(drafter: DFlash2Model, hidden_BNKD, logits_BNKV, labels_BNK,
                   prev_BNK) -> dict:
  """DFlash-2 selector terms [B, N, B−1]: K-way CE over the unary top-K with the gold
  injected as the K-th candidate when missing; teacher-forced predecessors."""
  k = drafter.cfg.selector_top_k
  _, cand_BNKk = top_k(jax.lax.stop_gradient(logits_BNKV), k)
  match = cand_BNKk == labels_BNK[..., None]
  recall_BNK = jnp.any(match, axis=-1)
  gold_BNK = jnp.where(recall_BNK, jnp.argmax(match, axis=-1), k - 1)
  cand_BNKk = cand_BNKk.at[..., k - 1].set(
      jnp.where(recall_BNK, cand_BNKk[..., k - 1], labels_BNK))
  unary_BNKk = jnp.take_along_axis(logits_BNKV, cand_BNKk, axis=-1)
  b, n, g = labels_BNK.shape
  scores = drafter.candidate_selector.scores(
      unary_BNKk.reshape(b, n * g, k), hidden_BNKD.reshape(b, n * g, -1),
      prev_BNK.reshape(b, n * g), cand_BNKk.reshape(b, n * g, k)).reshape(b, n, g, k)
  return {
      'sel_ce': token_cross_entropy(scores, gold_BNK),
      'sel_hit': (jnp.argmax(scores, axis=-1) == gold_BNK) & recall_BNK,
      'recall': recall_BNK,
  }


def _run_sum(hit_BNK, block_valid_BN):
  run_BN = jnp.sum(jnp.cumprod(hit_BNK.astype(jnp.int32), axis=-1), axis=-1)
  return jnp.sum(jnp.where(block_valid_BN, run_BN, 0))


def dflash_sums(terms: dict) -> dict:
  """Sums from which loss, slot-1 accuracy and the greedy τ estimate are ratios (and the
  selector's loss, τ estimate and top-K recall for DFlash-2)."""
  valid = terms['valid']
  sums = {
      'weighted_ce': jnp.sum(terms['ce'] * terms['weight']),
      'weight': jnp.sum(terms['weight']),
      'hit1': jnp.sum(terms['hit'][..., 0] & valid[..., 0]),
      'valid1': jnp.sum(valid[..., 0]),
      'run': _run_sum(terms['hit'] & valid, terms['block_valid']),
      'blocks': jnp.sum(terms['block_valid']),
  }
  if 'sel_ce' in terms:
    sums.update(sel_weighted_ce=jnp.sum(terms['sel_ce'] * terms['weight']),
                sel_run=_run_sum(terms['sel_hit'] & valid, terms['block_valid']),
                recall=jnp.sum(terms['recall'] & valid), valid=jnp.sum(valid))
  return sums


def dflash_metrics(sums: dict) -> dict:
  """loss, acc1 (slot-1 top-1) and tau_est (1 + mean leading run of correct slots); for
  DFlash-2 also sel_loss, sel_tau_est (the teacher-forced greedy walk's run) and
  recall (gold in the unary top-K)."""
  weight = jnp.maximum(sums['weight'], 1e-6)
  blocks = jnp.maximum(sums['blocks'], 1)
  m = {
      'loss': sums['weighted_ce'] / weight,
      'acc1': sums['hit1'] / jnp.maximum(sums['valid1'], 1),
      'tau_est': 1.0 + sums['run'] / blocks,
  }
  if 'sel_weighted_ce' in sums:
    m.update(sel_loss=sums['sel_weighted_ce'] / weight,
             sel_tau_est=1.0 + sums['sel_run'] / blocks,
             recall=sums['recall'] / jnp.maximum(sums['valid'], 1))
  return m


def dflash_loss(drafter, target, batch, key, *, num_anchors: int, gamma: float,
                anchor_supervised: bool = True, selector_alpha: float = 1.0):
  """The DFlash loss (plus selector_alpha × the selector loss for a DFlash-2 drafter)."""
  tokens_BS, loss_mask_BS = batch['tokens'], batch['loss_mask']
  taps = target_taps(target, tokens_BS, drafter.cfg.target_layer_ids)
  anchors_BN = sample_anchors(key, loss_mask_BS, num_anchors, anchor_supervised)
  m = dflash_metrics(dflash_sums(dflash_terms(drafter, target, taps, tokens_BS,
                                              loss_mask_BS, anchors_BN, gamma)))
  loss = m.pop('loss')
  if 'sel_loss' in m:
    m['unary_loss'] = loss
    loss = loss + selector_alpha * m['sel_loss']
  return loss, m


def bd3lm_noise(key, batch: int, seq_len: int, block_size: int, eps_min: float,
                eps_max: float, keep_first: bool):
  """(t per token [B, S], drop [B, S]): antithetic t per block in [eps_min, eps_max]."""
  nb = seq_len // block_size
  n = batch * nb
  k_perm, k_u, k_drop = jax.random.split(key, 3)
  strata = jax.random.permutation(k_perm, n).astype(jnp.float32)
  u = (jax.random.uniform(k_u, (n,)) + strata) / n
  t_BK = (eps_min + u * (eps_max - eps_min)).reshape(batch, nb)
  t_BS = jnp.repeat(t_BK, block_size, axis=1)
  drop_BS = jax.random.uniform(k_drop, (batch, seq_len)) < t_BS
  if keep_first:
    drop_BS &= (jnp.arange(seq_len) % block_size != 0)[None]
  return t_BS, drop_BS


def bd3lm_terms(drafter: DFlashModel, target, taps_BSND, tokens_BS, drop_BS):
  """(CE [B, S] of the x_t half given which tokens are masked (S % B == 0), whether
  each label is in the draft vocabulary [B, S])."""
  cfg = drafter.cfg
  b, s = tokens_BS.shape
  pos_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))
  ctx_k, ctx_v = drafter.context_kv(drafter.fuse(taps_BSND, target), pos_BS)
  x_t_BS = jnp.where(drop_BS, cfg.mask_token_id, tokens_BS)
  mask = BD3LMContextMask(block_size=cfg.block_size, seq_len=s)
  hidden_BSD = drafter(target.embed(x_t_BS), pos_BS, ctx_k, ctx_v, mask, None,
                       context_first=False)
  label_idx_BS = drafter.draft_index(tokens_BS)
  ce_BS = token_cross_entropy(drafter.draft_logits(target, hidden_BSD),
                              jnp.maximum(label_idx_BS, 0))
  return ce_BS, label_idx_BS >= 0


def bd3lm_loss(drafter, target, batch, key, *, eps_min: float, eps_max: float,
               keep_first: bool):
  big_b = drafter.cfg.block_size
  s = batch['tokens'].shape[1]
  pad = (-s) % big_b
  tokens_BS = jnp.pad(batch['tokens'], ((0, 0), (0, pad)))
  loss_mask_BS = jnp.pad(batch['loss_mask'], ((0, 0), (0, pad)))
  b, s = tokens_BS.shape
  taps = target_taps(target, tokens_BS, drafter.cfg.target_layer_ids)
  t_BS, drop_BS = bd3lm_noise(key, b, s, big_b, eps_min, eps_max, keep_first)
  ce_BS, in_vocab_BS = bd3lm_terms(drafter, target, taps, tokens_BS, drop_BS)
  on_BS = (drop_BS & loss_mask_BS & in_vocab_BS).astype(jnp.float32)
  loss = jnp.sum(ce_BS * on_BS / t_BS) / jnp.maximum(jnp.sum(loss_mask_BS), 1)
  masked_ce = jnp.sum(ce_BS * on_BS) / jnp.maximum(jnp.sum(on_BS), 1.0)
  return loss, {'masked_ce': masked_ce}


# ------------------------------------------------------------------------------- task


# DFlash-2 fields of the `dflash` config section (absent from DFlash configs).
DFLASH2_FIELDS = ('conv_kernel_size', 'conv_group_size', 'selector_rank', 'selector_top_k')


def build_drafter(cfg, target_cfg, tokenizer_mask_id=None, draft_vocab=()) -> DFlashModel:
  """A freshly initialised drafter for the config's `dflash` section and the target: a
  DFlash-2 drafter for training.task = dflash2 (its convs start as the identity).

  mask_token_id < 0 takes the tokenizer's mask id, else the last vocab row. Optional keys
  layer_types / is_causal select z-lab's per-layer attention (sliding_window then is the
  per-query window of the sliding layers).
  """
  d = cfg.dflash
  mask_id = d.mask_token_id
  if mask_id < 0:
    mask_id = target_cfg.vocab_size - 1 if tokenizer_mask_id is None else tokenizer_mask_id
  fields = dict(layer_types=tuple(d.get('layer_types', ())), is_causal=d.get('is_causal'))
  config_class, drafter_class = DFlashConfig, DFlashModel
  if cfg.training.task == 'dflash2':
    config_class, drafter_class = DFlash2Config, DFlash2Model
    fields.update({k: d[k] for k in DFLASH2_FIELDS})
  dcfg = config_class.create(
      num_target_layers=target_cfg.num_layers, num_layers=d.num_layers,
      block_size=d.block_size, mask_token_id=mask_id,
      target_layer_ids=tuple(d.target_layer_ids), sliding_window=d.sliding_window or None,
      attention_impl=d.attention_impl, draft_vocab=draft_vocab, **fields)
  return drafter_class(dcfg, target_cfg, rngs=nnx.Rngs(cfg.training.seed))


def build_task(cfg, workdir: str) -> TrainTask:
  """The 'dflash', 'dflash2' or 'bd3lm' task: drafter on `cfg.data.path` for the target
  `cfg.model`."""
  del workdir
  from dspec.loading import build_target
  from dspec.training.distill import load_distilled, split_distilled
  tcfg, d = cfg.training, cfg.dflash
  target, tokenizer, _ = build_target(cfg.model)
  data = load_distilled(cfg.data.path, target.cfg.vocab_size)
  rows = split_distilled(data, tcfg.seq_len, cfg.data.heldout_fraction, tcfg.eval_windows,
                         cfg.data.path)
  tokens, loss_mask = rows.tokens[rows.train_rows], rows.loss_mask[rows.train_rows]
  held_tokens, held_mask = rows.held_tokens, rows.held_mask
  draft_vocab = ()
  if d.draft_vocab_size:
    draft_vocab = frequent_tokens(tokens, loss_mask, d.draft_vocab_size,
                                  target.cfg.vocab_size, 'dflash.draft_vocab_size')
  drafter = build_drafter(cfg, target.cfg, tokenizer.mask_id, draft_vocab)

  def get_batch(step: int) -> dict:
    return rows.batch(step, tcfg.seed, tcfg.batch_size)

  gamma = loss_gamma(d.block_size, d.loss_gamma)
  if tcfg.task in ('dflash', 'dflash2'):
    loss_fn = functools.partial(dflash_loss, num_anchors=d.num_anchors, gamma=gamma,
                                anchor_supervised=d.anchor_supervised,
                                selector_alpha=d.get('selector_loss_alpha', 1.0))
  else:
    loss_fn = functools.partial(bd3lm_loss, eps_min=d.eps_min, eps_max=d.eps_max,
                                keep_first=d.keep_first)

  @jax.jit
  def eval_sums(model, target, tokens_BS, loss_mask_BS, key):
    taps = target_taps(target, tokens_BS, model.cfg.target_layer_ids)
    anchors_BN = sample_anchors(key, loss_mask_BS, d.num_anchors, d.anchor_supervised)
    return dflash_sums(dflash_terms(model, target, taps, tokens_BS, loss_mask_BS,
                                    anchors_BN, gamma))

  def evaluate(model, target) -> dict:
    """DFlash-style held-out metrics (same for both objectives, so they compare) and the
    decode walk's τ."""
    total = None
    bs = tcfg.batch_size
    for i in range(0, len(held_tokens), bs):
      chunk_t, chunk_m = held_tokens[i:i + bs], held_mask[i:i + bs]
      short = bs - len(chunk_t)   # pad the last chunk with unsupervised rows
      chunk_t = np.pad(chunk_t, ((0, short), (0, 0)))
      chunk_m = np.pad(chunk_m, ((0, short), (0, 0)))
      sums = eval_sums(model, target, chunk_t, chunk_m, jax.random.key(i))
      total = sums if total is None else jax.tree.map(jnp.add, total, sums)
    return {**{k: float(v) for k, v in dflash_metrics(total).items()},
            **walk_metrics(model, target, held_tokens, held_mask)}

  trained_on = checkpoint.target_record(target, cfg.model)

  def export(model, path, step):
    save_dflash(path, model, storage_dtype=tcfg.storage_dtype, force=True,
                extra={'train_step': step, **trained_on})

  return TrainTask(model=drafter, frozen=target, loss_fn=loss_fn, get_batch=get_batch,
                   evaluate=evaluate, export=export)
