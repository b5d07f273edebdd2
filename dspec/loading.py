"""Loading a target model and its tokenizer: dspec checkpoints, Hugging Face directories, or
random weights described by a config's `model` section."""

from __future__ import annotations

import os
from typing import Optional

from flax import nnx

from dspec import checkpoint, sharding
from dspec.models.config import TransformerConfig
from dspec.models.transformer import Transformer
from dspec.tokenizer import load_tokenizer


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


def build_target(model_cfg, placement: Optional[sharding.Placement] = None):
  """(Transformer, tokenizer, max_seq_len) from a config's `model` section.

  source: random (shape, seed) | checkpoint (a dspec checkpoint at path) | hf (a Hugging
  Face Llama/Qwen3 directory at path). The tokenizer comes from `tokenizer_dir`, else from
  the weights' directory, else bytes. With a `placement`, params live on its mesh (random
  init: created already sharded).
  """
  source = model_cfg.source
  if source == 'random':
    cfg = TransformerConfig(**model_cfg.shape)
    ctor = lambda: Transformer(cfg, rngs=nnx.Rngs(model_cfg.seed))
    target = placement.for_model(cfg).create_module(ctor) if placement else ctor()
    weights_dir = None
  elif source == 'checkpoint':
    target, _ = load_target_checkpoint(model_cfg.path)
    weights_dir = model_cfg.path
  elif source == 'hf':
    from dspec import hf_import
    target, _ = hf_import.load_hf_model(model_cfg.path)
    weights_dir = model_cfg.path
  else:
    raise ValueError(f'unknown model.source {source!r}; use random, checkpoint or hf')
  tok_dir = model_cfg.tokenizer_dir or weights_dir
  if tok_dir and not os.path.exists(os.path.join(tok_dir, 'tokenizer.json')):
    tok_dir = None if not model_cfg.tokenizer_dir else tok_dir
  tokenizer = load_tokenizer(tok_dir, target.cfg.vocab_size)
  if placement and source != 'random':
    sharding.place_module(target, placement.for_model(target.cfg))
  return target, tokenizer, model_cfg.max_seq_len
