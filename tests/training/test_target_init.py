"""`training.init_from` starts target (and joint MTP) training from a saved target."""


import jax
import numpy as np
import pytest
from flax import nnx

from configs import demo_target
from dspec import checkpoint
from dspec.models.config import TransformerConfig
from dspec.models.transformer import Transformer
from dspec.training import target_lm

def test_init_from_loads_the_saved_target_and_checks_its_shape(tmp_path):
  cfg = demo_target.get_config('quick')
  shape = TransformerConfig(**cfg.model.shape)
  saved = Transformer(shape, rngs=nnx.Rngs(7))
  path = str(tmp_path / 'saved')
  checkpoint.save_model(path, saved, kind='target', config=shape.to_dict())
  cfg.training.init_from = path
  task = target_lm.build_task(cfg, str(tmp_path / 'run'))
  for a, b in zip(jax.tree.leaves(nnx.state(task.model, nnx.Param)),
                  jax.tree.leaves(nnx.state(saved, nnx.Param))):
    np.testing.assert_array_equal(a, b)

  other = TransformerConfig(**dict(cfg.model.shape, mlp_dim=2 * shape.mlp_dim))
  checkpoint.save_model(path, Transformer(other, rngs=nnx.Rngs(0)), kind='target',
                        config=other.to_dict(), force=True)
  with pytest.raises(ValueError, match='another shape'):
    target_lm.build_task(cfg, str(tmp_path / 'run'))
