"""Next-token pretraining of the target LM on a mixture of text corpora."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspec import checkpoint
from dspec.models.config import TransformerConfig
from dspec.models.transformer import Transformer
from dspec.tokenizer import load_tokenizer
from dspec import datasets
from dspec.training import corpus
from dspec.training.losses import masked_mean, token_cross_entropy
from dspec.training.trainer import TrainTask


def packed_windows(cfg, tokenizer, which: str, cache_dir: str) -> dict[str, np.ndarray]:
  """Per-corpus [N, seq_len + 1] windows of the train or held-out split, cached as .npy."""
  out = {}
  for name in cfg.training.mixture:
    path = os.path.join(cache_dir, f'{name}_{which}_{cfg.training.seq_len}.npy')
    if not os.path.exists(path):
      docs = datasets.split_documents(datasets.load_corpus(name, cfg.data_dir),
                                    cfg.training.heldout_fraction, which)
      windows = corpus.pack_tokens(docs, tokenizer, cfg.training.seq_len, tokenizer.eos_id)
      os.makedirs(cache_dir, exist_ok=True)
      np.save(path + '.tmp.npy', windows)
      os.replace(path + '.tmp.npy', path)
    out[name] = np.load(path)
    if not len(out[name]):
      raise ValueError(f'corpus {name!r} gave no {which} windows of seq_len '
                       f'{cfg.training.seq_len}')
  return out


def lm_loss(model, frozen, batch, key):
  del frozen, key
  tokens = batch['tokens']
  logits = model(tokens[:, :-1]).logits_BTV
  ce = token_cross_entropy(logits, tokens[:, 1:])
  loss = masked_mean(ce, jnp.ones_like(ce))
  return loss, {}


def init_target(model: Transformer, path: str) -> None:
  """Starts from a saved target of the same shape (continued training, fine-tuning)."""
  saved = checkpoint.read_model_metadata(path, 'target')['config']
  if TransformerConfig.from_dict(saved) != model.cfg:
    raise ValueError(f'training.init_from={path} holds a target of another shape than '
                     f'cfg.model.shape')
  checkpoint.load_model_state(path, model, 'target')


def build_task(cfg, workdir: str) -> TrainTask:
  """The target-pretraining task described by a demo_target-style config (from random
  weights, or from the target at `training.init_from` when set)."""
  tcfg = cfg.training
  model_cfg = TransformerConfig(**cfg.model.shape)
  tokenizer = load_tokenizer(cfg.model.tokenizer_dir or None, model_cfg.vocab_size)
  if tokenizer.vocab_size > model_cfg.vocab_size:
    raise ValueError(f'tokenizer vocab {tokenizer.vocab_size} > model vocab '
                     f'{model_cfg.vocab_size}')
  cache_dir = os.path.join(workdir, 'data')
  train = packed_windows(cfg, tokenizer, 'train', cache_dir)
  heldout = packed_windows(cfg, tokenizer, 'heldout', cache_dir)
  names = list(tcfg.mixture)
  weights = np.array([tcfg.mixture[n] for n in names], np.float64)
  weights /= weights.sum()

  def get_batch(step: int) -> dict:
    rng = np.random.default_rng([tcfg.seed, step])
    which = rng.choice(len(names), size=tcfg.batch_size, p=weights)
    rows = [train[names[i]][rng.integers(len(train[names[i]]))] for i in which]
    return {'tokens': np.stack(rows)}

  eval_loss = jax.jit(lambda m, t: lm_loss(m, None, {'tokens': t}, None)[0])

  def evaluate(model, frozen):
    out = {}
    for name, windows in heldout.items():
      chunk = windows[:tcfg.eval_windows]
      losses = [float(eval_loss(model, jnp.asarray(chunk[i:i + tcfg.batch_size])))
                for i in range(0, len(chunk) - tcfg.batch_size + 1, tcfg.batch_size)]
      out[f'heldout_loss/{name}'] = float(np.mean(losses)) if losses else float('nan')
    return out

  def export(model, path, step):
    checkpoint.save_model(path, model, kind='target', config=model_cfg.to_dict(),
                          storage_dtype=tcfg.storage_dtype, extra={'train_step': step},
                          force=True)
    if cfg.model.tokenizer_dir:
      for name in ('tokenizer.json', 'tokenizer_config.json'):
        src = os.path.join(cfg.model.tokenizer_dir, name)
        if os.path.exists(src):
          shutil.copy(src, os.path.join(path, name))

  model = Transformer(model_cfg, rngs=nnx.Rngs(tcfg.seed))
  if tcfg.get('init_from'):
    init_target(model, tcfg.init_from)
  return TrainTask(model=model, frozen=None, loss_fn=lm_loss, get_batch=get_batch,
                   evaluate=evaluate, export=export)
