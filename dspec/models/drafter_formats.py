"""Published DFlash / DFlash-2 drafter formats: z-lab `dflash` and vLLM `speculators`.

Both are a directory with `config.json` and safetensors (`/work/notes/dflash_reference.md`
§5–6); dspec's own checkpoints are orbax directories (`checkpoint.save_model`).

z-lab form (`architectures` DFlashDraftModel | DFlash2DraftModel): a Qwen3 config of the
draft layers plus `num_target_layers` and `dflash_config` (each key is read from
`dflash_config`, then the top level, then z-lab's default). Taps `target_layer_ids` are
0-based layers whose outputs are read (`hidden_states[id + 1]`; the last layer's is the
post-final-norm hidden); the default is `zlab_target_layer_ids`.

speculators form (`speculators_model_type` dflash | dflash2): the draft layers' config in
`transformer_layer_config`, taps as HF hidden-state indices `aux_hidden_state_layer_ids`
(= z-lab id + 1), a reduced draft vocabulary via `draft_vocab_size` with `t2d` [V] bool /
`d2t` [V'] offsets (target id = draft index + d2t[index]). Its sliding-window layers are
causal unless `sliding_window_non_causal`; windows follow the serving semantics (per
query, as z-lab's). The reduced head is the target's rows (`lm_head.weight`, a frozen copy
of them, is not read).

A drafter imported from either form gets a `target_cfg` built from its own config (draft
layer shapes; the target's width, vocabulary and depth) and z-lab's attention semantics.
Every format error is one line naming the key or tensor and the file.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.flax import save_file

from dspec.checkpoint import CheckpointError, leaf_paths
from dspec.files import write_atomic, write_json_atomic
from dspec.hf_import import _open_safetensors, _rope_theta, _tensor_files
from dspec.models.config import TransformerConfig
from dspec.models.dflash import DFlashConfig, DFlashModel, load_dspec_checkpoint
from dspec.models.dflash2 import DFlash2Config, DFlash2Model

ZLAB_ARCHITECTURES = {'DFlashDraftModel': 'dflash', 'DFlash2DraftModel': 'dflash2'}
SPECULATORS_TYPES = ('dflash', 'dflash2')
_CLASSES = {'dflash': (DFlashModel, DFlashConfig), 'dflash2': (DFlash2Model, DFlash2Config)}
_DFLASH2_KEYS = ('conv_kernel_size', 'conv_group_size', 'selector_rank', 'selector_top_k')
# Qwen3Config defaults z-lab falls back to when a key is absent.
_QWEN3_DEFAULTS = {'num_key_value_heads': 32, 'head_dim': 128, 'rms_norm_eps': 1e-6,
                   'max_window_layers': 28, 'sliding_window': 4096}
# speculators tensors that never belong to the draft body (the verifier's, reloaded).
_SPECULATORS_IGNORED = ('embed_tokens.weight', 'verifier_lm_head.weight',
                        'verifier_norm.weight', 'lm_head.weight')


_KIND_NAMES = {int: 'an integer', float: 'a number', bool: 'true or false', list: 'a list',
               dict: 'an object'}


class FormatError(ValueError):
  """A drafter directory that does not follow its format (one line: file and key)."""


def zlab_target_layer_ids(num_target_layers: int, num_layers: int) -> tuple:
  """z-lab's default taps: [L // 2] for one layer, else round(1 + i·(L−4)/(n−1)) with
  Python's rounding, neither clipped nor deduplicated."""
  if num_layers == 1:
    return (num_target_layers // 2,)
  span = num_target_layers - 4
  return tuple(round(1 + i * span / (num_layers - 1)) for i in range(num_layers))


def read_tensor(stack: contextlib.ExitStack, handles: dict, file: str, name: str, leaf,
                transpose: bool):
  """Tensor `name` of safetensors `file` (opened once into `handles`) as the dtype of
  `leaf`, transposed from torch's [out, in] when asked; FormatError on a shape mismatch."""
  if file not in handles:
    handles[file] = stack.enter_context(_open_safetensors(file))
  tensor = handles[file].get_tensor(name)
  expected = leaf.shape[::-1] if transpose else leaf.shape
  if tuple(tensor.shape) != tuple(expected):
    raise FormatError(f'{file}: tensor {name!r} has shape {tuple(tensor.shape)}, '
                      f'expected {tuple(expected)}')
  return jnp.asarray(tensor.T if transpose else tensor, dtype=leaf.dtype)


def qwen3_layer_config(drafter, layer_types: list) -> dict:
  """The HF Qwen3 config fields of a DFlash-family drafter's layers (z-lab's config.json,
  speculators' `transformer_layer_config`)."""
  cfg, shapes = drafter.cfg, drafter.layer_cfg
  return dict(
      model_type='qwen3', hidden_size=shapes.embed_dim, num_hidden_layers=cfg.num_layers,
      num_attention_heads=shapes.num_heads, num_key_value_heads=shapes.num_kv_heads,
      head_dim=shapes.head_dim, intermediate_size=shapes.mlp_dim, hidden_act='silu',
      rms_norm_eps=shapes.norm_eps, vocab_size=shapes.vocab_size,
      rope_parameters={'rope_theta': shapes.rope_theta, 'rope_type': 'default'},
      attention_bias=False, tie_word_embeddings=False, layer_types=layer_types,
      use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window)


def check_exportable(drafter, form: str) -> None:
  """ValueError when a dspec DFlash-family drafter has no equivalent in `form` (z-lab,
  speculators): an anchor-relative window, no q/k norms, or the last target layer tapped
  before the final norm."""
  cfg, shapes = drafter.cfg, drafter.layer_cfg
  if not cfg.layer_types and cfg.sliding_window:
    raise ValueError(f"dspec's anchor-relative sliding_window has no {form} form")
  if not shapes.qk_norm:
    raise ValueError(f'{form} draft layers have q/k norms: a drafter without qk_norm has no '
                     f'{form} form')
  last = drafter.target_cfg.num_layers - 1
  if last in cfg.target_layer_ids and not cfg.final_tap_normed:
    raise ValueError(f'the drafter taps the last target layer ({last}) before the final '
                     f'norm; {form} reads it after')


def read_config(path) -> Optional[dict]:
  """The `config.json` of a drafter directory, or None when it has none (a dspec
  checkpoint); FileNotFoundError when the directory does not exist."""
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise FileNotFoundError(f'{path}: no such drafter directory')
  config_path = os.path.join(path, 'config.json')
  return _read_json(config_path) if os.path.exists(config_path) else None


def detect(path) -> str:
  """'zlab', 'speculators' or 'dspec' for a drafter directory."""
  config = read_config(path)
  if config is None:
    return 'dspec'
  if 'speculators_model_type' in config:
    return 'speculators'
  return 'zlab'


def load(path, *, num_target_layers: Optional[int] = None, dtype: str = 'float32',
         **overrides) -> DFlashModel:
  """A DFlash / DFlash-2 drafter from any supported directory (see `detect`).

  num_target_layers: the target's depth; checked against a z-lab config, needed by a
  speculators config whose verifier directory is not readable. `overrides` replace config
  fields (e.g. attention_impl); `dtype` is the parameter and compute dtype of imports.
  """
  path = os.fspath(path)
  kind = detect(path)
  if kind == 'dspec':
    try:
      return load_dspec_checkpoint(path, DFlash2Model, DFlash2Config, **overrides)
    except CheckpointError as e:
      if "holds a 'dflash' model" not in str(e):
        raise
    return load_dspec_checkpoint(path, **overrides)
  read = read_zlab if kind == 'zlab' else read_speculators
  return read(path, num_target_layers=num_target_layers, dtype=dtype, **overrides)


# ---------------------------------------------------------------------------- reading


def _read_json(path: str) -> dict:
  try:
    with open(path) as f:
      config = json.load(f)
  except json.JSONDecodeError as e:
    raise FormatError(f'{path}: not valid JSON ({e})') from None
  if not isinstance(config, dict):
    raise FormatError(f'{path}: not a JSON object')
  return config


class _Keys:
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

  def int_list(self, key, default=None, required=False):
    value = self.get(key, list, default, required)
    if value is not None and not all(isinstance(v, int) and not isinstance(v, bool)
                                     for v in value):
      raise self.error(key, f'must be a list of ints, got {value!r}')
    return value


def layer_rope_theta(keys: _Keys, model_types: tuple) -> float:
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
    return _rope_theta(keys.config)
  except ValueError as e:
    raise keys.error('rope_parameters', f'is not supported ({e})') from None


def _layer_shapes(keys: _Keys, num_target_layers: int, dtype: str) -> tuple:
  """(TransformerConfig of the draft layers with the target's depth, n layers, attention
  fields) from a Qwen3 config dict."""
  rope_theta = layer_rope_theta(keys, ('qwen3',))
  heads = keys.get('num_attention_heads', int, required=True)
  n = keys.get('num_hidden_layers', int, required=True)
  try:
    shapes = TransformerConfig(
        vocab_size=keys.get('vocab_size', int, required=True),
        num_layers=num_target_layers,
        embed_dim=keys.get('hidden_size', int, required=True),
        num_heads=heads,
        num_kv_heads=keys.get('num_key_value_heads', int,
                              _QWEN3_DEFAULTS['num_key_value_heads']),
        head_dim=keys.get('head_dim', int, _QWEN3_DEFAULTS['head_dim']),
        mlp_dim=keys.get('intermediate_size', int, required=True),
        rope_theta=rope_theta,
        norm_eps=keys.get('rms_norm_eps', float, _QWEN3_DEFAULTS['rms_norm_eps']),
        qk_norm=True, dtype=dtype, param_dtype=dtype)
  except ValueError as e:
    raise FormatError(f'{keys.file}: bad draft layer shapes ({e})') from None
  # Qwen3Config: the window exists only with use_sliding_window; absent layer_types are
  # sliding from max_window_layers on when it does.
  window = (keys.get('sliding_window', int, _QWEN3_DEFAULTS['sliding_window'])
            if keys.get('use_sliding_window', bool, False) else None)
  layer_types = keys.get('layer_types', list)
  if layer_types is None:
    first = keys.get('max_window_layers', int, _QWEN3_DEFAULTS['max_window_layers'])
    layer_types = ['sliding_attention' if window is not None and i >= first
                   else 'full_attention' for i in range(n)]
  if len(layer_types) != n or any(t not in ('full_attention', 'sliding_attention')
                                  for t in layer_types):
    raise keys.error('layer_types', f'must name full_attention or sliding_attention for '
                     f'each of the {n} layers, got {layer_types!r}')
  attention = dict(layer_types=tuple(layer_types), sliding_window=window,
                   is_causal=keys.get('is_causal', bool))
  return shapes, n, attention


def _build(kind: str, path: str, cfg_fields: dict, shapes: TransformerConfig, tensors,
           overrides: dict) -> DFlashModel:
  drafter_class, config_class = _CLASSES[kind]
  config_file = os.path.join(path, 'config.json')
  try:
    cfg = config_class(**cfg_fields, **overrides)
    drafter = nnx.eval_shape(lambda: drafter_class(cfg, shapes, rngs=nnx.Rngs(0)))
  except (TypeError, ValueError) as e:
    raise FormatError(f'{config_file}: {e}') from None
  _fill(drafter, path, tensors)
  return drafter


def _torch_name(dspec_name: str, codebook_suffix: bool) -> tuple:
  """(safetensors name, transposed) of a dotted dspec drafter param path."""
  parts = dspec_name.split('.')
  if parts[0] in ('attention_convs', 'mlp_convs'):
    parts = ['layers', parts[1], parts[0][:-1]] + parts[2:]
  name = '.'.join(parts)
  if name.endswith('.kernel'):
    return name[:-len('kernel')] + 'weight', True
  if name.endswith('_codebook') and codebook_suffix:
    return name + '.weight', False
  return name, False


def fill_params(model: nnx.Module, path: str, tensors: dict, locate) -> None:
  """Reads every param of the (abstract) `model` from safetensors, in place.

  tensors: {key: (file, stored name)}; locate(dspec param path) -> (key, transposed from
  torch's [out, in]). A key not in `tensors` is a missing tensor, and a tensor no param
  read is an error: both FormatErrors naming the tensor (and its file)."""
  state = nnx.state(model, nnx.Param)
  abstract = nnx.to_pure_dict(state)
  used = set()
  with contextlib.ExitStack() as stack:
    handles = {}

    def read(dspec_name, leaf):
      key, transpose = locate(dspec_name)
      if key not in tensors:
        raise FormatError(f'{path}: tensor {key!r} is missing')
      used.add(key)
      return read_tensor(stack, handles, *tensors[key], leaf, transpose)

    params = jax.tree.unflatten(jax.tree.structure(abstract),
                                [read(n, leaf) for n, leaf in leaf_paths(abstract).items()])
  extra = sorted(set(tensors) - used)
  if extra:
    file, name = tensors[extra[0]]
    raise FormatError(f'{file}: unexpected tensor {name!r} '
                      f'({len(extra)} the config does not use)')
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)


def _fill(drafter: DFlashModel, path: str, tensors: dict) -> None:
  """Reads every param of the (abstract) drafter from `tensors` {name: file}."""

  def locate(dspec_name):
    candidates = [_torch_name(dspec_name, True), _torch_name(dspec_name, False)]
    return next((c for c in candidates if c[0] in tensors), candidates[0])

  fill_params(drafter, path, {name: (file, name) for name, file in tensors.items()}, locate)


def read_zlab(path, *, num_target_layers: Optional[int] = None, dtype: str = 'float32',
              **overrides) -> DFlashModel:
  """A drafter from a z-lab directory (config.json + model.safetensors)."""
  path = os.fspath(path)
  file = os.path.join(path, 'config.json')
  config = _read_json(file)
  top = _Keys(config, file)
  archs = top.get('architectures', list, required=True)
  kinds = [ZLAB_ARCHITECTURES[a] for a in archs if a in ZLAB_ARCHITECTURES]
  if not kinds:
    raise top.error('architectures', f'names none of {sorted(ZLAB_ARCHITECTURES)}: {archs}')
  kind = kinds[0]
  draft = config.get('dflash_config') or {}
  if not isinstance(draft, dict):
    raise top.error('dflash_config', 'must be an object')
  inner = _Keys(draft, file, 'dflash_config.')

  def value(key, kind_, default=None, required=False):
    """dflash_config[key], else the top-level key, else the default (z-lab's order)."""
    if draft.get(key) is not None:
      return inner.get(key, kind_)
    if config.get(key) is None and required:
      raise inner.error(key, 'is missing (nor is it at the top level)')
    return top.get(key, kind_, default)

  depth = top.get('num_target_layers', int, required=True)
  if num_target_layers is not None and num_target_layers != depth:
    raise top.error('num_target_layers', f'is {depth} but the target has '
                    f'{num_target_layers} layers')
  shapes, n, attention = _layer_shapes(top, depth, dtype)
  if 'target_layer_ids' in draft and draft['target_layer_ids'] is not None:
    taps = inner.int_list('target_layer_ids')
  else:
    taps = top.int_list('target_layer_ids') or list(zlab_target_layer_ids(depth, n))
  fields = dict(
      num_layers=n, block_size=value('block_size', int, 16),
      target_layer_ids=tuple(taps),
      mask_token_id=value('mask_token_id', int, required=True),
      input_embedding_scale=value('input_embedding_scale', float, 1.0),
      output_multiplier=value('output_multiplier', float, 1.0),
      final_logit_softcapping=value('final_logit_softcapping', float),
      final_tap_normed=True, **attention)
  if kind == 'dflash2':
    fields.update({k: value(k, int, required=True) for k in _DFLASH2_KEYS})
  return _build(kind, path, fields, shapes, _tensor_files(path), overrides)


def _verifier_depth(spec: _Keys) -> Optional[int]:
  """num_hidden_layers of the verifier when its name_or_path is a readable directory."""
  verifier = (spec.config.get('speculators_config') or {}).get('verifier') or {}
  where = verifier.get('name_or_path') if isinstance(verifier, dict) else None
  config_path = os.path.join(where, 'config.json') if isinstance(where, str) else None
  if not config_path or not os.path.exists(config_path):
    return None
  config = _read_json(config_path)
  config = config.get('text_config') or config
  return _Keys(config, config_path).get('num_hidden_layers', int)


def _draft_vocab(path: str, tensors: dict, vocab: int, draft_vocab_size: int) -> tuple:
  """Target ids of the draft vocabulary from t2d / d2t (checked against each other)."""
  for name in ('t2d', 'd2t'):
    if name not in tensors:
      raise FormatError(f'{path}: tensor {name!r} is missing (draft_vocab_size '
                        f'{draft_vocab_size} < vocab {vocab})')
  with _open_safetensors(tensors['t2d']) as f:
    t2d = np.asarray(f.get_tensor('t2d'))
  with _open_safetensors(tensors['d2t']) as f:
    d2t = np.asarray(f.get_tensor('d2t'))
  ids = np.flatnonzero(t2d)
  if t2d.shape != (vocab,) or d2t.shape != (draft_vocab_size,) or len(ids) != len(d2t):
    raise FormatError(f'{tensors["t2d"]}: tensors t2d {t2d.shape} / d2t {d2t.shape} do not '
                      f'match vocab {vocab} and draft_vocab_size {draft_vocab_size}')
  if not np.array_equal(np.arange(len(d2t)) + d2t, ids):
    raise FormatError(f'{tensors["d2t"]}: tensor d2t does not map the draft vocabulary '
                      'onto the ids t2d marks')
  return tuple(int(i) for i in ids)


def read_speculators(path, *, num_target_layers: Optional[int] = None,
                     dtype: str = 'float32', **overrides) -> DFlashModel:
  """A drafter from a speculators directory (speculators_model_type dflash | dflash2)."""
  path = os.fspath(path)
  file = os.path.join(path, 'config.json')
  spec = _Keys(_read_json(file), file)
  kind = spec.config.get('speculators_model_type')
  if kind not in SPECULATORS_TYPES:
    raise spec.error('speculators_model_type', f'must be one of {SPECULATORS_TYPES}, got '
                     f'{kind!r}')
  if spec.get('sample_from_anchor', bool, False):
    raise spec.error('sample_from_anchor', 'is true (anchor-predicting blocks are not '
                     'DFlash)')
  depth = num_target_layers or _verifier_depth(spec)
  if depth is None:
    raise spec.error('speculators_config.verifier.name_or_path', 'is not a readable '
                     'directory: pass num_target_layers (the target depth)')
  layer = _Keys(spec.get('transformer_layer_config', dict, required=True), file,
                'transformer_layer_config.')
  shapes, n, attention = _layer_shapes(layer, depth, dtype)
  target_hidden = spec.get('target_hidden_size', int)
  if target_hidden not in (None, shapes.embed_dim):
    raise spec.error('target_hidden_size', f'{target_hidden} differs from the draft width '
                     f'{shapes.embed_dim}')
  if spec.get('sliding_window_non_causal', bool, kind == 'dflash2'):
    attention['is_causal'] = False
  aux = spec.int_list('aux_hidden_state_layer_ids', required=True)
  if not aux or min(aux) < 1:
    raise spec.error('aux_hidden_state_layer_ids', f'must be hidden-state indices >= 1, '
                     f'got {aux}')
  tensors = _tensor_files(path)
  vocab_size = spec.get('draft_vocab_size', int, shapes.vocab_size)
  draft_vocab = ()
  if vocab_size != shapes.vocab_size:
    draft_vocab = _draft_vocab(path, tensors, shapes.vocab_size, vocab_size)
  tensors = {k: v for k, v in tensors.items()
             if k not in _SPECULATORS_IGNORED + ('t2d', 'd2t')}
  fields = dict(num_layers=n, block_size=spec.get('block_size', int, 8),
                target_layer_ids=tuple(a - 1 for a in aux),
                mask_token_id=spec.get('mask_token_id', int, required=True),
                draft_vocab=draft_vocab, final_tap_normed=True, **attention)
  if kind == 'dflash2':
    defaults = dict(zip(_DFLASH2_KEYS, (2, 16, 256, 16)))
    fields.update({k: spec.get(k, int, defaults[k]) for k in _DFLASH2_KEYS})
  return _build(kind, path, fields, shapes, tensors, overrides)


# ---------------------------------------------------------------------------- writing


def zlab_config(drafter: DFlashModel) -> dict:
  """The z-lab config.json of a drafter (ValueError if z-lab cannot express it)."""
  cfg = drafter.cfg
  if cfg.draft_vocab:
    raise ValueError('a reduced draft vocabulary (draft_vocab) has no z-lab form')
  check_exportable(drafter, 'z-lab')
  layer_types = list(cfg.layer_types) or ['full_attention'] * cfg.num_layers
  kind = drafter.checkpoint_kind
  draft = dict(mask_token_id=cfg.mask_token_id, target_layer_ids=list(cfg.target_layer_ids),
               block_size=cfg.block_size, input_embedding_scale=cfg.input_embedding_scale,
               output_multiplier=cfg.output_multiplier)
  if cfg.final_logit_softcapping is not None:
    draft['final_logit_softcapping'] = cfg.final_logit_softcapping
  if kind == 'dflash2':
    draft.update({k: getattr(cfg, k) for k in _DFLASH2_KEYS})
  config = dict(
      architectures=['DFlash2DraftModel' if kind == 'dflash2' else 'DFlashDraftModel'],
      **qwen3_layer_config(drafter, layer_types),
      num_target_layers=drafter.target_cfg.num_layers, dflash_config=draft)
  if cfg.is_causal is not None:
    config['is_causal'] = cfg.is_causal
  return config


def save_zlab(path, drafter: DFlashModel, *, dtype: str = 'float32') -> None:
  """Writes `config.json` + `model.safetensors` in z-lab form (loadable by
  `dflash.DFlashDraftModel` / `DFlash2DraftModel.from_pretrained`)."""
  path = os.fspath(path)
  config = zlab_config(drafter)
  flat = leaf_paths(nnx.to_pure_dict(nnx.state(drafter, nnx.Param)))
  tensors = {}
  for name, leaf in flat.items():
    torch_name, transpose = _torch_name(name, True)
    array = jnp.asarray(leaf.T if transpose else leaf, dtype)
    tensors[torch_name] = array
  config['dtype'] = dtype
  os.makedirs(path, exist_ok=True)
  write_atomic(os.path.join(path, 'model.safetensors'),
               lambda tmp: save_file(tensors, tmp, metadata={'format': 'pt'}))
  write_json_atomic(os.path.join(path, 'config.json'), config, indent=2)
