"""`training.init_from` starts target, joint MTP and drafter training from a saved model."""


import jax
import numpy as np
import pytest
from flax import nnx

from configs import demo_target
from dspec import checkpoint
from dspec.models.config import TransformerConfig
from dspec.models.transformer import Transformer
from dspec.training import target_lm

@pytest.mark.slow
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


def test_drafter_tasks_warm_start_from_an_export_of_their_kind(tmp_path):
  from conftest import TINY
  from dspec.errors import UserError
  from dspec.models.dflash import DFlashConfig, DFlashModel, save_dflash
  from dspec.training import tasks, trainer

  dcfg = DFlashConfig(num_layers=1, block_size=4, target_layer_ids=(1,), mask_token_id=1)
  saved = DFlashModel(dcfg, TINY, rngs=nnx.Rngs(3))
  export = str(tmp_path / 'export')
  save_dflash(export, saved, extra={'train_step': 7})
  task = trainer.TrainTask(model=DFlashModel(dcfg, TINY, rngs=nnx.Rngs(4)), frozen=None,
                           loss_fn=None, get_batch=None)
  tcfg = demo_target.get_config('quick').training
  tcfg.task, tcfg.init_from = 'dflash', export
  tasks.warm_start_drafter(task, tcfg)
  for a, b in zip(jax.tree.leaves(nnx.state(task.model, nnx.Param)),
                  jax.tree.leaves(nnx.state(saved, nnx.Param))):
    np.testing.assert_array_equal(a, b)
  assert checkpoint.read_train_step(export) == 7

  tcfg.task = 'eagle3'   # another kind: one clear error naming the field and both kinds
  with pytest.raises(UserError, match=r"training.init_from=.*'dflash'.*'eagle3'"):
    tasks.warm_start_drafter(task, tcfg)


@pytest.mark.parametrize('kind', ['dflash2', 'dspark'])
def test_dflash2_and_dspark_start_from_a_dflash_backbone(tmp_path, kind):
  from conftest import TINY
  from dspec.errors import UserError
  from dspec.models.dflash import DFlashConfig, DFlashModel, save_dflash
  from dspec.models.dflash2 import DFlash2Config, DFlash2Model
  from dspec.models.dspark import DSparkConfig, DSparkModel
  from dspec.training import tasks, trainer

  shared = dict(num_layers=1, block_size=4, target_layer_ids=(1,), mask_token_id=1)
  backbone = DFlashModel(DFlashConfig(**shared), TINY, rngs=nnx.Rngs(3))
  export = str(tmp_path / 'export')
  save_dflash(export, backbone)
  model = (DFlash2Model(DFlash2Config(**shared, selector_rank=4, selector_top_k=2), TINY,
                        rngs=nnx.Rngs(4)) if kind == 'dflash2' else
           DSparkModel(DSparkConfig(**shared, markov_rank=4), TINY, rngs=nnx.Rngs(4)))
  before = checkpoint.leaf_paths(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  task = trainer.TrainTask(model=model, frozen=None, loss_fn=None, get_batch=None)
  tcfg = demo_target.get_config('quick').training
  tcfg.task, tcfg.init_from = kind, export
  tasks.warm_start_drafter(task, tcfg)

  after = checkpoint.leaf_paths(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  stored = checkpoint.leaf_paths(nnx.to_pure_dict(nnx.state(backbone, nnx.Param)))
  assert stored and set(stored) < set(after)
  for name, leaf in after.items():   # the backbone's params taken, the heads' kept
    np.testing.assert_array_equal(leaf, stored[name] if name in stored else before[name])

  tcfg.continue_from_init = True    # a backbone is not a run of this kind to continue
  with pytest.raises(UserError, match='continue_from_init'):
    tasks.warm_start_drafter(task, tcfg)
