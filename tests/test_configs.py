"""Every config file builds (with each documented preset); bad keys and types are refused."""

import glob
import importlib
import os

import ml_collections
import pytest

from conftest import REPO_ROOT
from configs import common

CONFIG_ARGS = {
    'tiny': [None, 'batch=2'],
    'hf': ['/some/hf/dir'],
    'demo_target': [None, 'quick', 'steps=10,minutes=1.5'],
    'distill_demo': [None, 'tiny', 'sampled'],
    'mtp_demo': [None, 'tiny', 'joint', 'tiny,joint,depths=2,beta=0.5'],
    'demo': [None, 'drafter=dflash,index=3', 'drafter=dflash2'],
}
DECODE_FIELDS = ('max_new_tokens', 'temperature', 'top_k', 'top_p', 'seed', 'batch_size',
                 'drafter', 'compare_ar', 'mesh')


def _config_names():
  paths = glob.glob(os.path.join(REPO_ROOT, 'configs', '*.py'))
  return sorted(os.path.splitext(os.path.basename(p))[0] for p in paths
                if not os.path.basename(p).startswith(('_', 'common')))


@pytest.mark.parametrize('name', _config_names())
def test_every_config_builds(name):
  module = importlib.import_module(f'configs.{name}')
  assert module.__doc__ and 'python scripts/' in module.__doc__, 'docstring gives the command'
  for arg in CONFIG_ARGS.get(name, [None]):
    cfg = module.get_config(arg)
    assert isinstance(cfg, ml_collections.ConfigDict)
    for field in DECODE_FIELDS:
      assert field in cfg, f'{name}:{arg} lacks {field}'


def test_preset_parsing_rejects_unknown_and_casts_types():
  args = common.parse_arg('quick,steps=7', quick=False, steps=1, lr=0.1)
  assert args.quick is True and args.steps == 7
  with pytest.raises(ValueError, match='unknown config argument'):
    common.parse_arg('nope=1', quick=False)
  with pytest.raises(ValueError):
    common.parse_arg('steps=abc', steps=1)


def test_locked_config_refuses_unknown_keys_and_wrong_types():
  cfg = common.decode_config('tiny')
  cfg.lock()
  with pytest.raises(AttributeError):
    cfg.not_a_field = 1
  with pytest.raises(TypeError):
    cfg.max_new_tokens = 'many'
