"""Sharding on 8 simulated CPU devices: identical tokens and losses on every mesh.

The mesh checks need `--xla_force_host_platform_device_count=8` before jax starts, so
they run in two subprocesses (`mesh_checks.py --part=decode|rest`, side by side) that
print JSON; the tests below assert on it. Golden PartitionSpecs of every target param
for `fsdp=2,tensor=4` live in golden/ (rewrite: `mesh_checks.py --part=rest --golden=..`).
"""

import json
import os
import subprocess
import sys

import jax
import pytest

from configs import common
from dspec import sharding
from dspec.decoding.state import DecodeStats
from dspec.models.kv_cache import KVCache

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, 'golden', 'param_specs_fsdp2_tensor4.json')
DRAFTERS = ('ar', 'ngram', 'oracle', 'self', 'mtp', 'dflash')


def _merge(into: dict, other: dict) -> dict:
  for key, value in other.items():
    if isinstance(value, dict) and isinstance(into.get(key), dict):
      _merge(into[key], value)
    else:
      into[key] = value
  return into


@pytest.fixture(scope='module')
def mesh_results():
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  procs = [subprocess.Popen([sys.executable, os.path.join(HERE, 'mesh_checks.py'),
                             f'--part={part}'], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
           for part in ('decode', 'rest')]
  result = {}
  for proc in procs:
    out, err = proc.communicate(timeout=900)
    line = next((l for l in out.splitlines() if l.startswith('RESULT ')), None)
    assert proc.returncode == 0 and line, f'mesh checks failed:\n{err[-4000:]}'
    _merge(result, json.loads(line[len('RESULT '):]))
  assert result['devices'] == 8
  return result


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize('name', DRAFTERS)
def test_tokens_identical_on_every_mesh(mesh_results, name):
  """Every drafter on every mesh writes the tokens of AR on one device (greedy: lossless
  and placement-independent at once)."""
  if name in mesh_results['skipped']:
    pytest.skip(mesh_results['skipped'][name])
  runs = mesh_results['decode'][name]
  assert set(runs) == {'data=8', 'data=2,tensor=4', 'tensor=8'} | ({'1'} if name == 'ar'
                                                                    else set())
  one_device_ar = mesh_results['decode']['ar']['1']
  assert sum(map(len, one_device_ar)) > 0
  for mesh, outs in runs.items():
    assert outs == one_device_ar, f'{name} on {mesh} differs from AR on 1 device'


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize('name', ['ngram_tree', 'mtp_tree'])
def test_token_trees_on_a_mesh_give_ar_tokens(mesh_results, name):
  """verify_length=tree (n-gram tries, the MTP heads' EAGLE-2 trees) on data=2,tensor=4:
  the tokens of AR on one device."""
  runs = mesh_results['decode'][name]
  assert set(runs) == {'data=2,tensor=4'}
  assert runs['data=2,tensor=4'] == mesh_results['decode']['ar']['1']


@pytest.mark.multiprocess
@pytest.mark.slow
def test_structured_output_on_a_mesh_gives_constrained_ar_tokens(mesh_results):
  """A regex constraint on the demo target: MTP (fixed, and token trees) on
  data=4,tensor=2 writes constrained AR's tokens of one device."""
  runs = mesh_results['structured']
  ar = runs['none:fixed:1']
  assert all(ar) and set(runs) == {'none:fixed:1', 'mtp:fixed:data=4,tensor=2',
                                   'mtp:tree:data=4,tensor=2'}
  for name, ids in runs.items():
    assert ids == ar, name


@pytest.mark.multiprocess
@pytest.mark.slow
def test_params_created_sharded_equal_one_device(mesh_results):
  assert all(mesh_results['created_sharded_equal'].values())


@pytest.mark.multiprocess
@pytest.mark.slow
def test_state_sharding_batch_on_data_kv_heads_on_tensor(mesh_results):
  specs = mesh_results['state_specs']
  assert specs['cache/k_LBSKD'] == [None, 'data', None, 'tensor']
  assert specs['drafter_state/k_LBSKD'] == [None, 'data', None, 'tensor']
  assert specs['tokens_BL'] == ['data'] and specs['step'] == []


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize('task', ('target', 'mtp', 'dflash'))
def test_sharded_train_step_gives_the_same_loss(mesh_results, task):
  if task in mesh_results['train_skipped']:
    pytest.skip(mesh_results['train_skipped'][task])
  losses = mesh_results['train'][task]
  assert len(losses) >= 2
  for mesh, loss in losses.items():
    assert loss == pytest.approx(losses['1'], rel=1e-5), mesh


@pytest.mark.multiprocess
@pytest.mark.slow
def test_param_sharding_matches_golden(mesh_results):
  with open(GOLDEN) as f:
    golden = json.load(f)
  assert golden['mesh'] == 'fsdp=2,tensor=4'
  assert mesh_results['param_specs'] == golden['param_specs']


@pytest.mark.multiprocess
@pytest.mark.slow
def test_mesh_that_does_not_fit_gets_a_clear_error(mesh_results):
  errors = mesh_results['errors']
  assert 'num_heads=4' in errors['heads'] and 'tensor=8' in errors['heads']
  assert 'needs 3 devices, found 8' in errors['mesh_size']
  assert "'model=8'" in errors['axis_name']
  assert 'batch size 3' in errors['batch']
  assert mesh_results['kv_rule_tensor8'] is None   # 4 kv heads on tensor=8: replicated


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pallas_kernel_is_shard_mapped_and_exact(mesh_results):
  assert mesh_results['kernel']['shard_map']
  assert mesh_results['kernel']['max_abs_diff'] < 1e-6


@pytest.mark.multiprocess
@pytest.mark.slow
def test_decode_runner_on_a_mesh_is_lossless(mesh_results):
  assert mesh_results['runner']['lossless'] is True
  assert len(mesh_results['runner']['output_ids']) == 8
  # A second call in the same buckets reuses the placed engines' programs (their one LRU),
  # as on one device.
  assert mesh_results['runner']['again_lossless'] is True
  assert mesh_results['runner']['again_engine_compiles'] == []


# ------------------------------------------------------------- single-process units

def test_config_rules_are_the_library_defaults():
  assert common.decode_config('tiny').sharding_rules == sharding.DEFAULT_RULES
  assert common.training_config('target').mesh == ''


def test_parse_mesh_spec():
  assert sharding.parse_mesh_spec('data=2,tensor=4') == {'data': 2, 'fsdp': 1, 'tensor': 4}
  assert sharding.parse_mesh_spec('fsdp=-1') == {'data': 1, 'fsdp': -1, 'tensor': 1}
  for bad, match in (('data', 'name=size'), ('pipe=2', 'name=size'), ('data=0', '>= 1'),
                     ('data=2,data=2', 'twice'), ('data=-1,fsdp=-1', 'at most one')):
    with pytest.raises(ValueError, match=match):
      sharding.parse_mesh_spec(bad)


def test_logical_axes_from_param_paths_and_declared_state_axes():
  assert sharding.param_logical_axes('layers/3/self_attn/k_proj/kernel', 2) == \
      ('embed', 'kv_heads')
  assert sharding.param_logical_axes('depths/0/eh_proj/kernel', 2) == (None, 'embed')
  assert sharding.param_logical_axes('mystery', 3) == (None, None, None)
  cache = KVCache.zeros(1, 2, 4, 1, 3)
  state = {'cache': cache, 'stats': DecodeStats.zeros(2, 3, 5)}
  axes = {sharding.path_str(p): sharding.state_logical_axes(state, p, x.ndim)
          for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
  assert axes['cache/k_LBSKD'] == ('layers', 'batch', 'cache_len', 'kv_heads', 'head_dim')
  assert axes['stats/accept_hist_BG1'] == ('batch', None)
  assert axes['stats/row0_committed_S'] == (None,)
  renamed = {'cache': {'k_LBSKD': cache.k_LBSKD}}   # a leaf nothing declares
  path = jax.tree_util.tree_flatten_with_path(renamed)[0][0][0]
  with pytest.raises(ValueError, match='no declared logical axes'):
    sharding.state_logical_axes(renamed, path, 5)
