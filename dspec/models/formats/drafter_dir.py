"""A drafter directory: which form it is in, and reading its config.json and safetensors.

Forms (`detect`): 'dspec' (an orbax checkpoint, no config.json), 'speculators'
(`speculators_model_type`), 'deepseek' (a HF checkpoint with MTP layers,
`num_nextn_predict_layers`), 'zlab' (a z-lab DFlash architecture), else 'legacy'
(SafeAILab / SpecForge EAGLE-3). Each drafter kind reads some of them (`read_drafter`).
Every format error is one line naming the key or tensor and the file.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Mapping, Optional

import numpy as np

from dspec.config_checks import check_stored_config
from dspec.errors import CheckpointError, UserError
from dspec.models.config import TransformerConfig
from dspec.models.formats.config_fields import (PROPOSAL_FIELDS, SPECULATORS_CONFIG_FIELDS,
                                                VERIFIER_FIELDS, unknown_fields)
from dspec.models.formats.hf_config import rope_theta
from dspec.models.formats.safetensors_io import check_one_model, read_params, read_tensor

ZLAB_ARCHITECTURES = {'DFlashDraftModel': 'dflash', 'DFlash2DraftModel': 'dflash2'}
# How each form with a config.json is recognised (the words of a wrong-form error).
FORMS = {
    'speculators': 'a speculators config (speculators_model_type)',
    'zlab': f"a z-lab config ('architectures' naming one of {sorted(ZLAB_ARCHITECTURES)})",
    'deepseek': 'a checkpoint with MTP layers (num_nextn_predict_layers)',
    'legacy': 'a legacy EAGLE-3 config (midlayer.* tensors)',
}

_KIND_NAMES = {int: 'an integer', float: 'a number', bool: 'true or false', list: 'a list',
               dict: 'an object'}


class FormatError(CheckpointError):
  """A drafter directory that does not follow its format (one line: file and key)."""


def read_json(path: str) -> dict:
  """A JSON object file whose numbers are finite and in range
  (`config_checks.check_stored_config`); FormatError naming it otherwise."""
  try:
    with open(path) as f:
      config = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise FormatError(f'{path}: not valid JSON ({e})') from None
  except OSError as e:
    raise FormatError(f'{path}: cannot be read ({e.strerror or e})') from None
  if not isinstance(config, dict):
    raise FormatError(f'{path}: not a JSON object')
  try:
    check_stored_config(config)
  except UserError as e:
    raise FormatError(f'{path}: {e}') from None
  return config


def read_config(path) -> Optional[dict]:
  """The `config.json` of a drafter directory, or None when it has none (a dspec
  checkpoint); CheckpointError when the directory does not exist or holds two models'
  files (`check_one_model`)."""
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise CheckpointError(f'{path}: no such drafter directory')
  check_one_model(path)
  config_path = os.path.join(path, 'config.json')
  return read_json(config_path) if os.path.exists(config_path) else None


def form_of(config: Optional[dict]) -> str:
  """The form of a drafter directory whose config.json is `config` (None: none)."""
  if config is None:
    return 'dspec'
  if 'speculators_model_type' in config:
    return 'speculators'
  if 'num_nextn_predict_layers' in config:
    return 'deepseek'
  if any(a in ZLAB_ARCHITECTURES for a in config.get('architectures') or []):
    return 'zlab'
  return 'legacy'


def detect(path) -> str:
  """The form of the drafter directory `path` (see the module docstring)."""
  return form_of(read_config(path))


def read_drafter(path, readers: Mapping[str, Callable], **options):
  """The drafter in directory `path`, read by `readers[its form](path, **options)`; a
  FormatError names the forms `readers` take when it is in another."""
  path = os.fspath(path)
  form = detect(path)
  if form not in readers:
    known = [FORMS[f] for f in readers if f != 'dspec']
    expected = 'not ' + known[0] if len(known) == 1 else 'neither ' + ' nor '.join(known)
    raise FormatError(f'{os.path.join(path, "config.json")}: {expected}')
  return readers[form](path, **options)


class ConfigKeys:
  """Typed reads from a config dict with errors naming the key and the file."""

  def __init__(self, config: dict, file: str, prefix: str = ''):
    self.config, self.file, self.prefix = config, file, prefix

  def error(self, key: str, what: str) -> FormatError:
    return FormatError(f'{self.file}: key {self.prefix + key!r} {what}')

  def get(self, key, kind, default=None, required=False):
    value = self.config.get(key)
    if value is None:
      if required:
        raise self.error(key, 'is missing')
      return default
    ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          bool: lambda v: isinstance(v, bool),
          list: lambda v: isinstance(v, list),
          dict: lambda v: isinstance(v, dict)}[kind](value)
    if not ok:
      raise self.error(key, f'must be {_KIND_NAMES[kind]}, got {value!r}')
    return float(value) if kind is float else value

  def check_known(self, known) -> None:
    """FormatError naming the first field of the config that is not in `known` (fields
    read or known to be metadata): refused rather than silently ignored."""
    unknown = unknown_fields(self.config, known)
    if unknown:
      more = f' ({len(unknown) - 1} more unknown)' if len(unknown) > 1 else ''
      raise self.error(unknown[0], 'is not a field dspec reads or knows to be metadata: '
                       f'refused rather than ignored{more}')

  def nested(self, key: str) -> 'ConfigKeys':
    """Typed reads from the object under `key` ({} when absent)."""
    return ConfigKeys(self.get(key, dict, {}), self.file, f'{self.prefix}{key}.')

  def int_list(self, key, default=None, required=False):
    value = self.get(key, list, default, required)
    if value is not None and not all(isinstance(v, int) and not isinstance(v, bool)
                                     for v in value):
      raise self.error(key, f'must be a list of ints, got {value!r}')
    return value


def config_keys(path: str) -> ConfigKeys:
  """Typed reads from the config.json of the drafter directory `path`."""
  file = os.path.join(path, 'config.json')
  return ConfigKeys(read_json(file), file)


def speculators_keys(path: str, fields: Mapping[str, frozenset]) -> tuple:
  """(`config_keys(path)`, its speculators_model_type), a FormatError unless that is one
  of `fields` (speculators_model_type -> the fields its config may hold)."""
  spec = config_keys(path)
  kind = spec.config.get('speculators_model_type')
  kinds = tuple(fields)
  if kind not in kinds:
    raise spec.error('speculators_model_type', f'must be {" or ".join(map(repr, kinds))}, '
                     f'got {kind!r}')
  spec.check_known(fields[kind])
  if spec.get('tie_word_embeddings', bool, False):
    raise spec.error('tie_word_embeddings', 'is true: a speculators drafter\'s head is not '
                     'its embedding')
  record = spec.nested('speculators_config')
  record.check_known(SPECULATORS_CONFIG_FIELDS)
  record.nested('verifier').check_known(VERIFIER_FIELDS)
  methods = record.get('proposal_methods', list, [])
  for i, method in enumerate(methods):
    if not isinstance(method, dict):
      raise record.error(f'proposal_methods[{i}]', f'must be an object, got {method!r}')
    ConfigKeys(method, spec.file, f'{record.prefix}proposal_methods[{i}].').check_known(
        PROPOSAL_FIELDS)
  return spec, kind


def layer_rope_theta(keys: ConfigKeys, model_types: tuple) -> float:
  """Checks a draft-layer config dict (model_type in `model_types`, unbiased SiLU layers,
  default RoPE) and returns its rope theta; FormatError naming the key otherwise."""
  model_type = keys.config.get('model_type', model_types[0])
  if model_type not in model_types:
    raise keys.error('model_type', f'must be one of {model_types} (the draft layers), got '
                     f'{model_type!r}')
  if keys.get('attention_bias', bool, False) or keys.get('mlp_bias', bool, False):
    raise keys.error('attention_bias', 'is true: biased draft layers are not supported')
  act = keys.config.get('hidden_act', 'silu')
  if act != 'silu':
    raise keys.error('hidden_act', f'must be "silu", got {act!r}')
  try:
    return rope_theta(keys.config)
  except ValueError as e:
    raise keys.error('rope_parameters', f'is not supported ({e})') from None


# Defaults of the HF layer-config classes of draft layers: `to_diff_dict` (how speculators
# and z-lab save a layer config) leaves out every value equal to its class default.
_LAYER_DEFAULTS = {
    'qwen3': {'num_key_value_heads': 32, 'head_dim': 128, 'sliding_window': 4096,
              'max_window_layers': 28},
    'llama': {},
}
LAYER_TYPES = ('full_attention', 'sliding_attention')


def read_draft_layers(keys: ConfigKeys, model_types: tuple, depth: int, dtype: str, *,
                      qk_norm: Optional[bool] = None,
                      num_layers_default: Optional[int] = None) -> tuple:
  """(TransformerConfig of the draft layers with the target's `depth`, their count n, their
  layer_types, the sliding window or None) of a HF layer config whose model_type is one of
  `model_types`, read with its class's defaults. Qwen3: the window exists only with
  use_sliding_window, and absent layer_types are sliding from max_window_layers on. Llama:
  the window is the sliding_window key (an extra attribute speculators sets) and layers are
  full unless layer_types says otherwise. qk_norm None: the model type's (Qwen3 has q/k
  norms)."""
  theta = layer_rope_theta(keys, model_types)
  model_type = keys.config.get('model_type', model_types[0])
  defaults = _LAYER_DEFAULTS[model_type]
  hidden = keys.get('hidden_size', int, required=True)
  heads = keys.get('num_attention_heads', int, required=True)
  n = keys.get('num_hidden_layers', int, num_layers_default,
               required=num_layers_default is None)
  try:
    shapes = TransformerConfig(
        vocab_size=keys.get('vocab_size', int, required=True), num_layers=depth,
        embed_dim=hidden, num_heads=heads,
        num_kv_heads=keys.get('num_key_value_heads', int,
                              defaults.get('num_key_value_heads', heads)),
        head_dim=keys.get('head_dim', int, defaults.get('head_dim', hidden // heads)),
        mlp_dim=keys.get('intermediate_size', int, required=True), rope_theta=theta,
        norm_eps=keys.get('rms_norm_eps', float, 1e-6),
        qk_norm=model_type == 'qwen3' if qk_norm is None else qk_norm,
        dtype=dtype, param_dtype=dtype)
  except ValueError as e:
    raise FormatError(f'{keys.file}: bad draft layer shapes ({e})') from None
  if model_type == 'qwen3':
    window = (keys.get('sliding_window', int, defaults['sliding_window'])
              if keys.get('use_sliding_window', bool, False) else None)
  else:
    window = keys.get('sliding_window', int)
  if window is not None and window < 1:
    raise keys.error('sliding_window', f'must be >= 1, got {window}')
  layer_types = keys.get('layer_types', list)
  if layer_types is None:
    first = keys.get('max_window_layers', int, defaults.get('max_window_layers', n))
    layer_types = ['sliding_attention' if model_type == 'qwen3' and window is not None
                   and i >= first else 'full_attention' for i in range(n)]
  if len(layer_types) != n or any(t not in LAYER_TYPES for t in layer_types):
    raise keys.error('layer_types', f'must name full_attention or sliding_attention for '
                     f'each of the {n} layers, got {layer_types!r}')
  return shapes, n, tuple(layer_types), window


def verifier_depth(spec: ConfigKeys) -> Optional[int]:
  """num_hidden_layers of a speculators config's verifier when its name_or_path is a
  readable directory."""
  verifier = (spec.config.get('speculators_config') or {}).get('verifier') or {}
  where = verifier.get('name_or_path') if isinstance(verifier, dict) else None
  config_path = os.path.join(where, 'config.json') if isinstance(where, str) else None
  if not config_path or not os.path.exists(config_path):
    return None
  config = read_json(config_path)
  config = config.get('text_config') or config
  return ConfigKeys(config, config_path).get('num_hidden_layers', int)


def read_draft_vocab(path: str, tensors: dict, vocab: int, draft_vocab_size: int) -> tuple:
  """Target ids of a speculators draft vocabulary from its t2d / d2t tensors (checked
  against each other); tensors: {name: file}."""
  for name in ('t2d', 'd2t'):
    if name not in tensors:
      raise FormatError(f'{path}: tensor {name!r} is missing (draft_vocab_size '
                        f'{draft_vocab_size} < vocab {vocab})')
  t2d = read_tensor(tensors['t2d'], 't2d', FormatError)
  d2t = read_tensor(tensors['d2t'], 'd2t', FormatError)
  ids = np.flatnonzero(t2d)
  if t2d.shape != (vocab,) or d2t.shape != (draft_vocab_size,) or len(ids) != len(d2t):
    raise FormatError(f'{tensors["t2d"]}: tensors t2d {t2d.shape} / d2t {d2t.shape} do not '
                      f'match vocab {vocab} and draft_vocab_size {draft_vocab_size}')
  if not np.array_equal(np.arange(len(d2t)) + d2t, ids):
    raise FormatError(f'{tensors["d2t"]}: tensor d2t does not map the draft vocabulary '
                      'onto the ids t2d marks')
  return tuple(int(i) for i in ids)


def fill_params(model, path: str, tensors: dict, locate: Callable) -> None:
  """Reads every param of the (abstract) `model` from safetensors, in place.

  tensors: {key: (file, stored name)}; locate(dspec param path) -> (key, transposed from
  torch's [out, in]). A key not in `tensors` is a missing tensor, and a tensor no param
  read is an error: both FormatErrors naming the tensor (and its file)."""
  used = read_params(model, tensors, locate, path, FormatError)
  extra = sorted(set(tensors) - used)
  if extra:
    file, name = tensors[extra[0]]
    raise FormatError(f'{file}: unexpected tensor {name!r} '
                      f'({len(extra)} the config does not use)')
