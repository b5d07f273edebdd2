"""dspec's own drafter checkpoints: `checkpoint.save_model` with the config of the drafter
under its kind and the target's under 'target' (`save_dflash`, `save_eagle3`, `save_mtp`).
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from dspec import checkpoint
from dspec.models.config import TransformerConfig


def load(path, model_class, config_class, **overrides):
  """The `model_class` drafter of a dspec checkpoint of its `checkpoint_kind`; `overrides`
  replace config fields (e.g. attention_impl)."""
  kind = model_class.checkpoint_kind
  metadata = checkpoint.read_model_metadata(path, kind)
  try:
    cfg = config_class.from_dict(metadata['config'][kind])
    target_cfg = TransformerConfig.from_dict(metadata['config']['target'])
  except (KeyError, TypeError, ValueError) as e:
    raise checkpoint.CheckpointError(f'{path}: bad {kind} config in metadata ({e})') from e
  cfg = dataclasses.replace(cfg, **overrides)
  model = nnx.eval_shape(lambda: model_class(cfg, target_cfg, rngs=nnx.Rngs(0)))
  checkpoint.load_model_state(path, model, kind)
  return model
