"""Loading a target model and its tokenizer: dspec checkpoints, Hugging Face directories, or
random weights described by a config's `model` section."""

from __future__ import annotations

import os
from typing import Optional

from flax import nnx

from dspec import checkpoint, sharding
from dspec.models.config import TransformerConfig
from dspec.models.formats.safetensors_io import check_one_model
from dspec.models.transformer import Transformer
from dspec.models.widen import widen_mlp
from dspec.tokenizer import IdsOnlyTokenizer, declared_eos_ids, load_tokenizer


def load_target_checkpoint(path) -> tuple[Transformer, dict]:
  """A `kind='target'` dspec checkpoint as a new Transformer; returns (model, metadata)."""
  metadata = checkpoint.read_model_metadata(path, 'target')
  try:
    cfg = TransformerConfig.from_dict(metadata['config'])
  except (KeyError, TypeError, ValueError) as e:
    raise checkpoint.CheckpointError(f'{path}: bad target config in metadata ({e})') from e
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  checkpoint.load_model_state(path, model, 'target')
  return model, metadata


def target_source(path: str) -> str:
  """'checkpoint' for a dspec checkpoint directory, 'hf' for a Hugging Face one (with a
  config.json); ValueError otherwise."""
  if os.path.isdir(os.path.join(path, 'metadata')) or \
      os.path.isfile(os.path.join(path, '_CHECKPOINT_METADATA')):
    return 'checkpoint'
  if os.path.isfile(os.path.join(path, 'config.json')):
    return 'hf'
  raise ValueError(f'{path}: neither a dspec checkpoint nor a Hugging Face model directory '
                   '(no config.json)')


def target_tokenizer(model_cfg, vocab_size: int, metadata: Optional[dict] = None):
  """The tokenizer of a config's `model` section (`metadata`: a checkpoint's).

  `tokenizer_dir` (it must hold a tokenizer.json), else the weights' tokenizer.json. A
  model without one that has a vocabulary of its own (a Hugging Face directory, or a
  checkpoint `convert_hf.py` wrote from one) takes token ids only, with the stop ids its
  own config declares (`tokenizer.IdsOnlyTokenizer`); dspec's own models (random weights,
  checkpoints dspec trained) fall back to bytes.
  """
  if model_cfg.tokenizer_dir:
    if not os.path.isfile(os.path.join(model_cfg.tokenizer_dir, 'tokenizer.json')):
      raise ValueError(f'model.tokenizer_dir={model_cfg.tokenizer_dir}: no tokenizer.json '
                       'there')
    return load_tokenizer(model_cfg.tokenizer_dir, vocab_size)
  if model_cfg.source == 'random':
    return load_tokenizer(None, vocab_size)
  extra = (metadata or {}).get('extra') or {}
  converted = 'hf_source' in extra
  if converted and not os.path.isfile(os.path.join(model_cfg.path, 'tokenizer.json')):
    eos_ids = list(extra.get('eos_token_ids') or ()) + declared_eos_ids(model_cfg.path)
    return IdsOnlyTokenizer(vocab_size, model_cfg.path, dict.fromkeys(eos_ids))
  return load_tokenizer(model_cfg.path, vocab_size, byte_fallback=model_cfg.source != 'hf'
                        and not converted)


def build_target(model_cfg, placement: Optional[sharding.Placement] = None):
  """(Transformer, tokenizer, max_seq_len) from a config's `model` section.

  source: random (shape, seed) | checkpoint (a dspec checkpoint at path) | hf (a Hugging
  Face Llama/Qwen3 directory at path). The tokenizer: `target_tokenizer`. `widen_mlp`
  (default 1) > 1 widens the MLPs that many times, same tokens (`models/widen.py`). With a
  `placement`, params live on its mesh (random init: created already sharded). A directory
  holding two models' files is refused (`check_one_model`).
  """
  source = model_cfg.source
  if source in ('checkpoint', 'hf'):
    check_one_model(model_cfg.path)
  if source == 'random':
    cfg = TransformerConfig(**model_cfg.shape)
    ctor = lambda: Transformer(cfg, rngs=nnx.Rngs(model_cfg.seed))
    target = placement.for_model(cfg).create_module(ctor) if placement else ctor()
    metadata = None
  elif source == 'checkpoint':
    target, metadata = load_target_checkpoint(model_cfg.path)
  elif source == 'hf':
    from dspec import hf_import
    target, _ = hf_import.load_hf_model(model_cfg.path)
    metadata = None
  else:
    raise ValueError(f'unknown model.source {source!r}; use random, checkpoint or hf')
  tokenizer = target_tokenizer(model_cfg, target.cfg.vocab_size, metadata)
  wide = widen_mlp(target, model_cfg.get('widen_mlp', 1))
  if placement and (source != 'random' or wide is not target):
    sharding.place_module(wide, placement.for_model(wide.cfg))
  return wide, tokenizer, model_cfg.max_seq_len
