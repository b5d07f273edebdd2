"""Checkpoints: model round trips, refusal of bad checkpoints, resumable training state."""

import glob
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from dspec.checkpoint import (CheckpointError, TrainCheckpointer, load_model_state,
                              load_tree, save_model, save_tree)
from dspec.loading import load_target_checkpoint as load_target
from dspec.models.config import TransformerConfig
from dspec.models.transformer import Transformer

TINY = TransformerConfig(vocab_size=64, num_layers=2, embed_dim=32, num_heads=4,
                         num_kv_heads=2, head_dim=8, mlp_dim=64, qk_norm=True)
TOKENS = jnp.arange(12, dtype=jnp.int32)[None, :] * 5 % 64


@pytest.fixture
def model():
  return Transformer(TINY, rngs=nnx.Rngs(0))


@pytest.fixture
def saved(tmp_path, model):
  path = tmp_path / 'ckpt'
  save_model(path, model, kind='target', config=TINY.to_dict(), extra={'note': 'tiny'})
  return path


@pytest.mark.slow
def test_target_round_trip_gives_identical_logits(saved, model):
  loaded, metadata = load_target(saved)
  assert metadata['kind'] == 'target'
  assert metadata['config'] == TINY.to_dict()
  assert metadata['extra'] == {'note': 'tiny'}
  assert metadata['storage_dtype'] == 'float32'
  np.testing.assert_array_equal(loaded(TOKENS).logits_BTV, model(TOKENS).logits_BTV)


def test_saved_checkpoint_names_no_path_of_the_writer(saved, model):
  """Shipped checkpoints (demo/, exports) carry no absolute path of the machine that wrote
  them, orbax's commit markers included; replacing one keeps that true."""
  save_model(saved, model, kind='target', config=TINY.to_dict(), force=True)
  for root, _, files in os.walk(saved):
    for name in files:
      with open(os.path.join(root, name), 'rb') as f:
        assert str(saved.parent).encode() not in f.read(), os.path.join(root, name)
  load_target(saved)


def test_bfloat16_storage_round_trip_is_close(tmp_path, model):
  path = tmp_path / 'bf16'
  save_model(path, model, kind='target', config=TINY.to_dict(), storage_dtype='bfloat16')
  tree, _ = load_tree(path)
  assert tree['embed_tokens'].dtype == jnp.bfloat16
  loaded, _ = load_target(path)
  assert loaded.embed_tokens[...].dtype == jnp.float32  # cast back to the param dtype
  np.testing.assert_allclose(loaded(TOKENS).logits_BTV, model(TOKENS).logits_BTV,
                             atol=2e-3, rtol=0)


def test_load_model_state_fills_an_abstract_module(saved, model):
  abstract = nnx.eval_shape(lambda: Transformer(TINY, rngs=nnx.Rngs(1)))
  load_model_state(saved, abstract, 'target')
  np.testing.assert_array_equal(abstract(TOKENS).logits_BTV, model(TOKENS).logits_BTV)


def test_existing_path_needs_force(saved, model):
  with pytest.raises(CheckpointError, match='already exists'):
    save_model(saved, model, kind='target', config=TINY.to_dict())
  zeros = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
  nnx.update(model, zeros)
  save_model(saved, model, kind='target', config=TINY.to_dict(), force=True)
  tree, _ = load_tree(saved)
  assert not np.any(tree['embed_tokens'])


def test_missing_path(tmp_path):
  with pytest.raises(CheckpointError, match='does not exist'):
    load_target(tmp_path / 'nowhere')


def _garble(path):
  data = bytearray(open(path, 'rb').read())
  for i in range(len(data) // 4, len(data)):
    data[i] ^= 0x5A
  with open(path, 'wb') as f:
    f.write(bytes(data))


@pytest.mark.parametrize('damage', [
    lambda p: shutil.rmtree(p / 'state'),
    lambda p: os.remove(p / 'state' / '_METADATA'),
    lambda p: [_garble(f) for f in glob.glob(str(p / 'state' / 'd' / '*'))],
    lambda p: _garble(p / 'state' / 'manifest.ocdbt'),
    lambda p: (p / 'metadata' / 'metadata').write_text('{not json'),
], ids=['no_state_dir', 'no_array_index', 'garbled_data', 'garbled_manifest',
        'garbled_metadata'])
def test_damaged_checkpoint_raises_one_line_error(saved, damage):
  damage(saved)
  with pytest.raises(CheckpointError) as info:
    load_target(saved)
  message = str(info.value)
  assert message.startswith(str(saved)) and '\n' not in message


def test_interrupted_save_leaves_nothing_loadable(tmp_path, model, monkeypatch):
  def crash(self, directory):
    raise KeyboardInterrupt('killed during finalize')

  monkeypatch.setattr(ocp.CompositeCheckpointHandler, 'finalize', crash)
  path = tmp_path / 'ckpt'
  with pytest.raises(KeyboardInterrupt):
    save_model(path, model, kind='target', config=TINY.to_dict())
  monkeypatch.undo()
  with pytest.raises(CheckpointError, match='does not exist'):
    load_target(path)
  leftovers = [p for p in tmp_path.iterdir() if p != path]
  for leftover in leftovers:  # orbax's temporary directory, if it stayed behind
    with pytest.raises(CheckpointError, match='unfinished'):
      load_target(leftover)


def test_shape_mismatch_names_leaf_and_shapes(saved):
  wider = TransformerConfig(**{**TINY.to_dict(), 'mlp_dim': 96})
  abstract = nnx.eval_shape(lambda: Transformer(wider, rngs=nnx.Rngs(0)))
  with pytest.raises(CheckpointError,
                     match=r"layers\.0\.mlp\.down_proj\.kernel.*\(64, 32\).*\(96, 32\)"):
    load_model_state(saved, abstract, 'target')


def test_structure_mismatch_and_wrong_kind(saved):
  no_qk_norm = nnx.eval_shape(lambda: Transformer(
      TransformerConfig(**{**TINY.to_dict(), 'qk_norm': False}), rngs=nnx.Rngs(0)))
  with pytest.raises(CheckpointError, match="extra leaves"):
    load_model_state(saved, no_qk_norm, 'target')
  with pytest.raises(CheckpointError, match="'target' model, expected 'dflash'"):
    load_model_state(saved, no_qk_norm, 'dflash')


def test_save_tree_load_tree_plain_pytree(tmp_path):
  tree = {'a': np.arange(6, dtype=np.int32).reshape(2, 3), 'b': [jnp.ones(4), jnp.zeros(())]}
  save_tree(tmp_path / 't', tree, {'hello': [1, 2]})
  restored, metadata = load_tree(tmp_path / 't')
  assert metadata == {'hello': [1, 2]}
  np.testing.assert_array_equal(restored['a'], tree['a'])
  restored, _ = load_tree(tmp_path / 't', jax.tree.map(np.asarray, tree))
  assert isinstance(restored['b'], list)
  np.testing.assert_array_equal(restored['b'][0], np.ones(4))
  with pytest.raises(CheckpointError, match="leaf 'c'"):
    load_tree(tmp_path / 't', {**tree, 'c': np.zeros(2)})


def _train_tree(params, step):
  return {'params': params, 'opt_state': optax.adamw(1e-2).init(params),
          'step': jnp.asarray(step, jnp.int32)}


def test_train_checkpointer_save_restore_with_adamw_state(tmp_path):
  params = {'w': jnp.ones((3, 4)), 'layers': {0: {'b': jnp.arange(2.0)}}}
  optimizer = optax.adamw(1e-2)
  opt_state = optimizer.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  trees = {}
  with TrainCheckpointer(tmp_path / 'run', max_to_keep=2) as ckpt:
    assert ckpt.latest_step() is None
    for step in (1, 2):
      updates, opt_state = optimizer.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      trees[step] = {'params': params, 'opt_state': opt_state,
                     'step': jnp.asarray(step, jnp.int32)}
      ckpt.save(step, trees[step], {'lr': 1e-2, 'step': step})
    ckpt.wait()
    assert ckpt.latest_step() == 2

  # A fresh checkpointer (as after a restart) finds and restores the latest step.
  resumed = TrainCheckpointer(tmp_path / 'run')
  step = resumed.latest_step()
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), trees[2])
  restored, metadata = resumed.restore(step, abstract)
  assert metadata == {'lr': 1e-2, 'step': 2}
  assert jax.tree.structure(restored) == jax.tree.structure(trees[2])
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(trees[2])):
    np.testing.assert_array_equal(got, want)
  earlier, _ = resumed.restore(1, trees[1])  # concrete arrays work as the target too
  np.testing.assert_array_equal(earlier['params']['w'], trees[1]['params']['w'])

  with pytest.raises(CheckpointError, match='no finished checkpoint for step 7'):
    resumed.restore(7, abstract)
  wrong = _train_tree({'w': jnp.ones((3, 5)), 'layers': {0: {'b': jnp.zeros(2)}}}, 0)
  with pytest.raises(CheckpointError,
                     match=r"leaf 'opt_state\.0\.mu\.w' has shape \(3, 4\).*\(3, 5\)"):
    resumed.restore(2, wrong)
  resumed.close()
