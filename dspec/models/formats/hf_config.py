"""Hugging Face Llama / Qwen3 `config.json` contents as a dspec TransformerConfig.

The target's HF import (`dspec.hf_import`) and the drafter formats whose layers are HF
layer configs (`dspec.models.formats`) read them here.
"""

from __future__ import annotations

from dspec.models.config import TransformerConfig
from dspec.models.formats.config_fields import TARGET_FIELDS, unknown_fields

SUPPORTED_MODEL_TYPES = ('llama', 'qwen3')


def _positive_int(hf_config: dict, key: str, default=None) -> int:
  """`hf_config[key]` (or `default` when absent or null) checked to be a positive integer."""
  value = hf_config.get(key)
  if value is None:
    if default is None:
      raise ValueError(f'required key {key!r} is missing')
    value = default
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise ValueError(f'{key} must be a positive integer, got {value!r}')
  return value


def _positive_float(value, key: str) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e30:
    raise ValueError(f'{key} must be a positive finite number, got {value!r}')
  return float(value)


def rope_theta(hf_config: dict) -> float:
  """RoPE base from transformers 4 (`rope_theta`, `rope_scaling`) or 5 (`rope_parameters`)
  config keys; every one present must say default RoPE and agree on the base."""
  thetas = []
  partial = [hf_config.get('partial_rotary_factor')] + [
      r.get('partial_rotary_factor') for r in (hf_config.get('rope_parameters'),
                                               hf_config.get('rope_scaling'))
      if isinstance(r, dict)]
  if any(f not in (None, 1, 1.0) for f in partial):
    raise ValueError(f'partial_rotary_factor {next(f for f in partial if f not in (None, 1))!r}'
                     ' is not supported (only rotation of the whole head)')
  for key in ('rope_parameters', 'rope_scaling'):
    rope = hf_config.get(key)
    if rope is None:
      continue
    if not isinstance(rope, dict):
      raise ValueError(f'{key} must be an object, got {rope!r}')
    rope_type = rope.get('rope_type', rope.get('type', 'default'))
    if rope_type not in (None, 'default'):
      raise ValueError(f'RoPE scaling type {rope_type!r} is not supported (only default '
                       'RoPE)')
    if rope.get('rope_theta') is not None:
      thetas.append(_positive_float(rope['rope_theta'], f'{key}.rope_theta'))
  if hf_config.get('rope_theta') is not None:
    thetas.append(_positive_float(hf_config['rope_theta'], 'rope_theta'))
  if len(set(thetas)) > 1:
    raise ValueError(f'the rope_theta values disagree ({sorted(set(thetas))})')
  return thetas[0] if thetas else 10_000.0


def config_from_hf(hf_config: dict, dtype: str = 'float32') -> TransformerConfig:
  """Maps a HF `config.json` dict (model_type llama or qwen3) to a TransformerConfig.

  `dtype` sets both the compute and the parameter dtype. Features dspec does not implement
  (biases, sliding windows, non-SiLU MLPs, scaled or partial RoPE), a field that is neither
  read nor known metadata (`config_fields.TARGET_FIELDS`), missing keys and values of the
  wrong type or sign raise ValueError naming the key.
  """
  if not isinstance(hf_config, dict):
    raise ValueError(f'config.json must hold a JSON object, got {type(hf_config).__name__}')
  model_type = hf_config.get('model_type')
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(f'model_type {model_type!r} is not supported; supported: '
                     f'{", ".join(SUPPORTED_MODEL_TYPES)}')
  unknown = unknown_fields(hf_config, TARGET_FIELDS)
  if unknown:
    raise ValueError(f'field {unknown[0]!r} is not one dspec reads or knows to be metadata '
                     f'for a {model_type} model: refused rather than ignored')
  if hf_config.get('attention_bias') or hf_config.get('mlp_bias'):
    raise ValueError('attention/MLP biases (attention_bias or mlp_bias = true) are not '
                     'supported')
  if hf_config.get('use_sliding_window'):
    raise ValueError('sliding-window attention (use_sliding_window = true) is not supported')
  layer_types = hf_config.get('layer_types') or ()
  if not isinstance(layer_types, (list, tuple)):
    raise ValueError(f'layer_types must be a list, got {layer_types!r}')
  if any(t != 'full_attention' for t in layer_types):
    raise ValueError(f'layer_types {hf_config["layer_types"]} are not supported '
                     '(only full_attention)')
  act = hf_config.get('hidden_act', 'silu')
  if act != 'silu':
    raise ValueError(f'hidden_act {act!r} is not supported (only silu)')
  hidden = _positive_int(hf_config, 'hidden_size')
  heads = _positive_int(hf_config, 'num_attention_heads')
  if hf_config.get('head_dim') is None and hidden % heads:
    raise ValueError(f'hidden_size={hidden} is not a multiple of '
                     f'num_attention_heads={heads} (and no head_dim is given)')
  return TransformerConfig(
      vocab_size=_positive_int(hf_config, 'vocab_size'),
      num_layers=_positive_int(hf_config, 'num_hidden_layers'),
      embed_dim=hidden,
      num_heads=heads,
      num_kv_heads=_positive_int(hf_config, 'num_key_value_heads', heads),
      head_dim=_positive_int(hf_config, 'head_dim', hidden // heads),
      mlp_dim=_positive_int(hf_config, 'intermediate_size'),
      rope_theta=rope_theta(hf_config),
      norm_eps=_positive_float(hf_config.get('rms_norm_eps') or 1e-6, 'rms_norm_eps'),
      qk_norm=model_type == 'qwen3',
      tie_embeddings=bool(hf_config.get('tie_word_embeddings', False)),
      dtype=dtype,
      param_dtype=dtype)
