"""Import Hugging Face Llama / Qwen3 checkpoints (config.json + safetensors) into dspec.

dspec parameter names mirror HF, so the mapping is mechanical (`hf_tensor_name`):
`layers.3.mlp.up_proj.kernel` <-> `model.layers.3.mlp.up_proj.weight` (transposed: nnx
kernels are [in, out], torch weights [out, in]); `embed_tokens` <-> `model.embed_tokens.weight`;
`lm_head` [D, V] <-> `lm_head.weight` [V, D] (absent when embeddings are tied).
MTP layers `model.layers.{L..L+n-1}.*` of a checkpoint with `num_nextn_predict_layers` = n
(DeepSeek-V3 layout) are not the target's: the MTP drafter reads them (`mtp_formats`).
"""

from __future__ import annotations

import contextlib
import json
import os

import jax
import jax.numpy as jnp
from flax import nnx
from safetensors import SafetensorError, safe_open

from dspec.checkpoint import leaf_paths
from dspec.models.config import TransformerConfig
from dspec.models.transformer import Transformer

SUPPORTED_MODEL_TYPES = ('llama', 'qwen3')
_SINGLE_FILE = 'model.safetensors'
_INDEX_FILE = 'model.safetensors.index.json'


def _positive_int(hf_config: dict, key: str, default=None) -> int:
  """`hf_config[key]` (or `default` when absent or null) checked to be a positive integer."""
  value = hf_config.get(key)
  if value is None:
    if default is None:
      raise ValueError(f'config.json lacks required key {key!r}')
    value = default
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise ValueError(f'config.json: {key} must be a positive integer, got {value!r}')
  return value


def _positive_float(value, key: str) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e30:
    raise ValueError(f'config.json: {key} must be a positive finite number, got {value!r}')
  return float(value)


def _rope_theta(hf_config: dict) -> float:
  """RoPE base from transformers 4 (`rope_theta`, `rope_scaling`) or 5 (`rope_parameters`)
  config keys; every one present must say default RoPE and agree on the base."""
  thetas = []
  for key in ('rope_parameters', 'rope_scaling'):
    rope = hf_config.get(key)
    if rope is None:
      continue
    if not isinstance(rope, dict):
      raise ValueError(f'config.json: {key} must be an object, got {rope!r}')
    rope_type = rope.get('rope_type', rope.get('type', 'default'))
    if rope_type not in (None, 'default'):
      raise ValueError(f'RoPE scaling type {rope_type!r} is not supported (only default '
                       'RoPE)')
    if rope.get('rope_theta') is not None:
      thetas.append(_positive_float(rope['rope_theta'], f'{key}.rope_theta'))
  if hf_config.get('rope_theta') is not None:
    thetas.append(_positive_float(hf_config['rope_theta'], 'rope_theta'))
  if len(set(thetas)) > 1:
    raise ValueError(f'config.json: the rope_theta values disagree ({sorted(set(thetas))})')
  return thetas[0] if thetas else 10_000.0


def config_from_hf(hf_config: dict, dtype: str = 'float32') -> TransformerConfig:
  """Maps a HF `config.json` dict (model_type llama or qwen3) to a TransformerConfig.

  `dtype` sets both the compute and the parameter dtype. Features dspec does not implement
  (biases, sliding windows, non-SiLU MLPs, scaled RoPE), missing keys and values of the
  wrong type or sign raise ValueError naming the key.
  """
  if not isinstance(hf_config, dict):
    raise ValueError(f'config.json must hold a JSON object, got {type(hf_config).__name__}')
  model_type = hf_config.get('model_type')
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(f'model_type {model_type!r} is not supported; supported: '
                     f'{", ".join(SUPPORTED_MODEL_TYPES)}')
  if hf_config.get('attention_bias') or hf_config.get('mlp_bias'):
    raise ValueError('attention/MLP biases (attention_bias or mlp_bias = true) are not '
                     'supported')
  if hf_config.get('use_sliding_window'):
    raise ValueError('sliding-window attention (use_sliding_window = true) is not supported')
  layer_types = hf_config.get('layer_types') or ()
  if not isinstance(layer_types, (list, tuple)):
    raise ValueError(f'config.json: layer_types must be a list, got {layer_types!r}')
  if any(t != 'full_attention' for t in layer_types):
    raise ValueError(f'layer_types {hf_config["layer_types"]} are not supported '
                     '(only full_attention)')
  act = hf_config.get('hidden_act', 'silu')
  if act != 'silu':
    raise ValueError(f'hidden_act {act!r} is not supported (only silu)')
  hidden = _positive_int(hf_config, 'hidden_size')
  heads = _positive_int(hf_config, 'num_attention_heads')
  if hf_config.get('head_dim') is None and hidden % heads:
    raise ValueError(f'config.json: hidden_size={hidden} is not a multiple of '
                     f'num_attention_heads={heads} (and no head_dim is given)')
  return TransformerConfig(
      vocab_size=_positive_int(hf_config, 'vocab_size'),
      num_layers=_positive_int(hf_config, 'num_hidden_layers'),
      embed_dim=hidden,
      num_heads=heads,
      num_kv_heads=_positive_int(hf_config, 'num_key_value_heads', heads),
      head_dim=_positive_int(hf_config, 'head_dim', hidden // heads),
      mlp_dim=_positive_int(hf_config, 'intermediate_size'),
      rope_theta=_rope_theta(hf_config),
      norm_eps=_positive_float(hf_config.get('rms_norm_eps') or 1e-6, 'rms_norm_eps'),
      qk_norm=model_type == 'qwen3',
      tie_embeddings=bool(hf_config.get('tie_word_embeddings', False)),
      dtype=dtype,
      param_dtype=dtype)


def hf_tensor_name(dspec_name: str) -> tuple[str, bool]:
  """HF tensor name of a dotted dspec param path, and whether the array is transposed."""
  if dspec_name == 'embed_tokens':
    return 'model.embed_tokens.weight', False
  if dspec_name == 'lm_head':
    return 'lm_head.weight', True
  if dspec_name.endswith('.kernel'):
    return f'model.{dspec_name[:-len("kernel")]}weight', True
  return f'model.{dspec_name}', False


def _ignorable(hf_name: str, cfg: TransformerConfig) -> bool:
  """Tensors HF itself ignores: a duplicate tied head and stale RoPE buffers."""
  return ((cfg.tie_embeddings and hf_name == 'lm_head.weight')
          or hf_name.endswith('rotary_emb.inv_freq'))


def _open_safetensors(path: str):
  if not os.path.exists(path):
    raise FileNotFoundError(f'{path}: safetensors file is missing')
  try:
    return safe_open(path, framework='flax')
  except SafetensorError as e:
    raise ValueError(f'{path}: unreadable safetensors file ({e})') from None


def _tensor_files(hf_dir: str) -> dict[str, str]:
  """Maps every tensor name to the safetensors file holding it."""
  index_path = os.path.join(hf_dir, _INDEX_FILE)
  single_path = os.path.join(hf_dir, _SINGLE_FILE)
  if os.path.exists(index_path):
    try:
      with open(index_path) as f:
        weight_map = json.load(f)['weight_map']
      return {name: os.path.join(hf_dir, file) for name, file in weight_map.items()}
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError,
            AttributeError) as e:
      raise ValueError(f'{index_path}: not a safetensors index ({e!r})') from None
  if os.path.exists(single_path):
    with _open_safetensors(single_path) as f:
      return {name: single_path for name in f.keys()}
  raise FileNotFoundError(f'{hf_dir}: no {_SINGLE_FILE} or {_INDEX_FILE}')


def read_hf_config(hf_dir) -> dict:
  """The parsed `config.json` of a HF model directory."""
  hf_dir = os.fspath(hf_dir)
  if not os.path.isdir(hf_dir):
    raise FileNotFoundError(f'{hf_dir}: no such model directory')
  path = os.path.join(hf_dir, 'config.json')
  if not os.path.exists(path):
    raise FileNotFoundError(f'{hf_dir}: no config.json')
  try:
    with open(path) as f:
      config = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f'{path}: not valid JSON ({e})') from None
  if not isinstance(config, dict):
    raise ValueError(f'{path}: must hold a JSON object, got {type(config).__name__}')
  return config


def load_hf_model(hf_dir, dtype: str = 'float32') -> tuple[Transformer, TransformerConfig]:
  """Builds a Transformer from a HF Llama/Qwen3 directory (single or sharded safetensors).

  Any missing, unexpected or mis-shaped tensor raises ValueError naming it.
  """
  hf_dir = os.fspath(hf_dir)
  hf_config = read_hf_config(hf_dir)
  cfg = config_from_hf(hf_config, dtype)
  nextn = hf_config.get('num_nextn_predict_layers')
  mtp_layers = tuple(f'model.layers.{cfg.num_layers + k}.'
                     for k in range(nextn if isinstance(nextn, int) else 0))
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  state = nnx.state(model, nnx.Param)
  abstract = nnx.to_pure_dict(state)
  flat = leaf_paths(abstract)
  files = _tensor_files(hf_dir)
  wanted = {hf_tensor_name(name)[0] for name in flat}
  extra = sorted(n for n in files if n not in wanted and not _ignorable(n, cfg)
                 and not n.startswith(mtp_layers))
  if extra:
    raise ValueError(f'{hf_dir}: unexpected tensor {extra[0]!r} '
                     f'({len(extra)} tensors the {cfg.num_layers}-layer config does not use)')

  with contextlib.ExitStack() as stack:
    handles = {}

    def read(dspec_name, leaf):
      hf_name, transpose = hf_tensor_name(dspec_name)
      if hf_name not in files:
        raise ValueError(f'{hf_dir}: tensor {hf_name!r} is missing')
      file = files[hf_name]
      if file not in handles:
        handles[file] = stack.enter_context(_open_safetensors(file))
      try:
        tensor = handles[file].get_tensor(hf_name)
      except SafetensorError as e:
        raise ValueError(f'{file}: cannot read tensor {hf_name!r} ({e})') from None
      expected = leaf.shape[::-1] if transpose else leaf.shape
      if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f'{hf_dir}: tensor {hf_name!r} has shape {tuple(tensor.shape)}, '
                         f'expected {tuple(expected)}')
      tensor = tensor.T if transpose else tensor
      return jnp.asarray(tensor, dtype=leaf.dtype)

    params = jax.tree.unflatten(jax.tree.structure(abstract),
                                [read(name, leaf) for name, leaf in flat.items()])
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)
  return model, cfg
