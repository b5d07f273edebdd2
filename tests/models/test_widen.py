"""MLP widening (`dspec/models/widen.py`): the same logits and tokens as the original
target, deterministic weights, and the original's fingerprint for drafters trained on it."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

import dspec
from configs import tiny
from dspec import checkpoint
from dspec.decoding import runner
from dspec.models.formats import load_mtp
from dspec.models.mtp import save_mtp
from dspec.models.widen import widen_mlp

TOKENS_BT = jnp.arange(100, 116, dtype=jnp.int32)[None]


@pytest.fixture(scope='module')
def demo():
  """demo/target and the same widened 4x, through the API."""
  return dspec.load_target('demo/target'), dspec.load_target('demo/target', widen_mlp=4)


def _params(model):
  return jax.tree.leaves(nnx.state(model, nnx.Param))


def _assert_same_logits(model, wide):
  want = model(TOKENS_BT).logits_BTV
  np.testing.assert_allclose(wide(TOKENS_BT).logits_BTV, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize('ratio', [2, 4])
def test_a_widened_tiny_target_has_the_same_logits_and_fixed_weights(tiny_model, ratio):
  wide = widen_mlp(tiny_model, ratio)
  assert wide.cfg.mlp_dim == ratio * tiny_model.cfg.mlp_dim
  assert wide.layers[0].mlp.down_proj.kernel.shape == (ratio * tiny_model.cfg.mlp_dim,
                                                       tiny_model.cfg.embed_dim)
  _assert_same_logits(tiny_model, wide)
  again = widen_mlp(tiny_model, ratio)
  assert all(np.array_equal(a, b) for a, b in zip(_params(wide), _params(again)))


def test_ratio_one_is_the_model_itself(tiny_model):
  assert widen_mlp(tiny_model, 1) is tiny_model


@pytest.mark.slow
def test_the_widened_demo_target_has_its_logits_and_greedy_tokens(demo):
  small, wide = demo
  assert wide.model.cfg.mlp_dim == 4 * small.model.cfg.mlp_dim
  _assert_same_logits(small.model, wide.model)
  _assert_same_logits(small.model, widen_mlp(small.model, 2))
  ids = [dspec.generate(t, ['def fibonacci(n):'], max_new_tokens=24,
                        verify_length='fixed').ids for t in (small, wide)]
  assert ids[0] == ids[1]


@pytest.mark.slow
def test_a_drafter_of_the_original_fits_the_widened_target(demo, tmp_path, tiny_model,
                                                           capsys):
  """The shipped drafters record no target; one re-saved with the demo target's record
  loads against the widened target without a warning, and still warns for another one."""
  small, wide = demo
  model_cfg = ml_collections.ConfigDict({'source': 'checkpoint', 'path': 'demo/target'})
  path = str(tmp_path / 'mtp')
  record = checkpoint.target_record(small.model, model_cfg)
  save_mtp(path, load_mtp('demo/mtp'), extra=record)
  assert checkpoint.target_fingerprint(wide.model) == checkpoint.weights_fingerprint(
      small.model)
  capsys.readouterr()
  dspec.load_drafter('mtp', path, target=wide)
  assert 'warning' not in capsys.readouterr().err
  assert checkpoint.check_target_record(path, widen_mlp(tiny_model, 2)) is not None


@pytest.mark.parametrize('value', [0, -1, 1.5, True])
def test_bad_widen_values_are_one_clear_error(value):
  with pytest.raises(ValueError, match='^widen_mlp must be ') as err:
    dspec.load_target('demo/target', widen_mlp=value)
  assert '\n' not in str(err.value)


@pytest.mark.slow
def test_the_decode_job_widens_its_target_and_says_so():
  cfg = tiny.get_config()
  cfg.model.widen_mlp = 2
  cfg.max_new_tokens = 4
  cfg.timing_repeats = 0
  messages = []
  report = runner.run_decode(cfg, [[1, 2, 3]], progress=messages.append)
  assert len(report['output_ids']) == 4
  widened = [m for m in messages if 'widened' in m]
  assert len(widened) == 1
  assert widened[0].startswith('target: random widened 2x in its MLPs: ')
  assert widened[0].endswith(' (float32), same tokens as random')
