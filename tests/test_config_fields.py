"""Every field of a published config.json is honoured or refused by name: each reader
(speculators EAGLE-3 / DFlash / DSpark / MTP, legacy EAGLE-3, z-lab, a HF target) refuses a
field it neither reads nor knows to be metadata with one line naming the field and the file;
known metadata is accepted; SGLang's `eagle_config` taps of a legacy EAGLE-3 are honoured."""

import json
import os

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from conftest import TINY
from dspec.models import dspark
from dspec.models.dflash import DFlashConfig, DFlashModel
from dspec.models.eagle3 import Eagle3Config, Eagle3Model
from dspec.models.formats import dflash as dflash_formats
from dspec.models.formats import dspark as dspark_formats
from dspec.models.formats import eagle3 as eagle3_formats
from dspec.models.formats.hf_config import config_from_hf
from dspec.models.mtp import MTP, MTPConfig
from dspec.models.formats import mtp as mtp_formats


def _edit(path, edit):
  config_path = os.path.join(path, 'config.json')
  config = json.load(open(config_path))
  edit(config)
  json.dump(config, open(config_path, 'w'))


@pytest.fixture(scope='module')
def dirs(tmp_path_factory):
  """A drafter directory in each published form dspec writes (tiny random weights)."""
  root = tmp_path_factory.mktemp('forms')
  eagle = Eagle3Model(Eagle3Config(target_layer_ids=(1, 0, 0), final_tap_normed=True), TINY,
                      rngs=nnx.Rngs(0))
  eagle3_formats.save_speculators(root / 'eagle3', eagle)
  legacy = root / 'legacy'
  legacy.mkdir()
  tensors = load_file(root / 'eagle3' / 'model.safetensors')
  save_file({k.replace('layers.0.', 'midlayer.'): v for k, v in tensors.items()},
            legacy / 'model.safetensors')
  layer = json.load(open(root / 'eagle3' / 'config.json'))['transformer_layer_config']
  json.dump(dict(layer, architectures=['LlamaForCausalLMEagle3'], torch_dtype='float32',
                 draft_vocab_size=TINY.vocab_size), open(legacy / 'config.json', 'w'))
  cfg = dspark.DSparkConfig.create(TINY.num_layers, num_layers=1, block_size=4,
                                   mask_token_id=63, target_layer_ids=(0,), markov_rank=4,
                                   layer_types=('full_attention',))
  dspark_formats.save_speculators(root / 'dspark', dspark.DSparkModel(cfg, TINY,
                                                                      rngs=nnx.Rngs(1)))
  cfg = DFlashConfig.create(TINY.num_layers, num_layers=1, block_size=4, mask_token_id=63,
                            target_layer_ids=(0,), layer_types=('full_attention',))
  dflash_formats.save_zlab(root / 'zlab', DFlashModel(cfg, TINY, rngs=nnx.Rngs(2)))
  mtp_formats.save_speculators(root / 'mtp', MTP(MTPConfig(num_depths=1, shared_depth=True),
                                                 TINY, rngs=nnx.Rngs(3)))
  return root


def _load(root, form):
  path = str(root / form)
  if form in ('eagle3', 'legacy'):
    return eagle3_formats.load_eagle3(path, target_cfg=TINY)
  if form == 'dspark':
    return dspark_formats.load_dspark(path, num_target_layers=TINY.num_layers)
  if form == 'zlab':
    return dflash_formats.load_dflash(path, num_target_layers=TINY.num_layers)
  return mtp_formats.load_mtp(path, target_cfg=TINY)


# (form, where the field goes: a path of keys into config.json, the key named in the error)
UNKNOWN = [
    ('eagle3', (), 'eagle_window'),
    ('eagle3', ('transformer_layer_config',), 'transformer_layer_config.logit_scale'),
    ('eagle3', ('speculators_config', 'proposal_methods', 0),
     'speculators_config.proposal_methods[0].tree_width'),
    ('legacy', (), 'logit_scale'),
    ('legacy', ('eagle_config',), 'eagle_config.topk'),
    ('dspark', (), 'markov_scale'),
    ('dspark', ('transformer_layer_config',), 'transformer_layer_config.qk_layernorm'),
    ('dspark', ('speculators_config', 'verifier'), 'speculators_config.verifier.revision'),
    ('zlab', (), 'logit_scale'),
    ('zlab', ('dflash_config',), 'dflash_config.anchor_stride'),
    ('mtp', (), 'mtp_loss_weight'),
    ('mtp', ('transformer_layer_config',), 'router_aux_loss_coef'),
]


@pytest.mark.parametrize('form, where, named', UNKNOWN,
                         ids=[f'{f}:{n}' for f, _, n in UNKNOWN])
def test_an_unknown_field_is_refused_by_name(dirs, tmp_path, form, where, named):
  import shutil
  path = tmp_path / form
  shutil.copytree(dirs / form, path)
  _load(tmp_path, form)          # as written: every field known

  def add(config):
    node = config
    for key in where:
      node = node.setdefault(key, {}) if isinstance(key, str) else node[key]
    node[named.rsplit('.', 1)[-1].split(']')[-1].lstrip('.')] = 1

  _edit(path, add)
  with pytest.raises(ValueError) as e:
    _load(tmp_path, form)
  message = str(e.value)
  assert '\n' not in message and 'config.json' in message, message
  assert repr(named) in message or repr(named.rsplit('.', 1)[-1]) in message, message


def test_legacy_eagle_config_taps_are_honoured(dirs, tmp_path):
  import shutil
  shutil.copytree(dirs / 'legacy', tmp_path / 'legacy')
  _edit(tmp_path / 'legacy', lambda c: c.update(eagle_config={
      'eagle_aux_hidden_state_layer_ids': [0, 2, 1], 'use_aux_hidden_state': True}))
  model = _load(tmp_path, 'legacy')
  assert model.cfg.target_layer_ids == (-1, 1, 0) and model.cfg.final_tap_normed
  with pytest.raises(ValueError, match=r"eagle_config.eagle_aux_hidden_state_layer_ids.* "
                                       r"not the \[1, 0, 0\] asked for"):
    eagle3_formats.load_eagle3(str(tmp_path / 'legacy'), target_cfg=TINY, taps=(1, 0, 0))


def test_values_dspec_does_not_implement_are_refused(dirs, tmp_path):
  import shutil
  shutil.copytree(dirs / 'eagle3', tmp_path / 'eagle3')
  _edit(tmp_path / 'eagle3', lambda c: c.update(tie_word_embeddings=True))
  with pytest.raises(ValueError, match="'tie_word_embeddings' is true"):
    _load(tmp_path, 'eagle3')
  hf = dict(model_type='qwen3', vocab_size=32, hidden_size=16, intermediate_size=32,
            num_hidden_layers=1, num_attention_heads=2, head_dim=8)
  config_from_hf(dict(hf, torch_dtype='bfloat16', use_cache=True, pretraining_tp=1,
                      max_window_layers=28, sliding_window=4096, use_sliding_window=False))
  with pytest.raises(ValueError, match="partial_rotary_factor 0.5 is not supported"):
    config_from_hf(dict(hf, partial_rotary_factor=0.5))
  with pytest.raises(ValueError, match="field 'quantization_config' is not one dspec reads"):
    config_from_hf(dict(hf, quantization_config={'quant_method': 'fp8'}))
