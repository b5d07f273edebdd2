"""Export a dspec Transformer to Hugging Face layout, or to a live `transformers` model.

The inverse of `hf_import`: same tensor names (`hf_tensor_name`), kernels transposed back to
torch's [out, in], no `lm_head.weight` when embeddings are tied. Writing needs no torch;
`to_transformers_model` (peer benchmarks, parity tests) needs the `hf` extra.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspec.checkpoint import leaf_paths
from dspec.hf_import import hf_tensor_name
from dspec.models.config import TransformerConfig
from dspec.models.formats.hf_config import SUPPORTED_MODEL_TYPES
from dspec.models.formats.safetensors_io import write_model_dir
from dspec.models.transformer import Transformer

_ARCHITECTURES = {'llama': 'LlamaForCausalLM', 'qwen3': 'Qwen3ForCausalLM'}


def hf_config_dict(cfg: TransformerConfig, model_type: str, *,
                   max_position_embeddings: int = 32768) -> dict:
  """The HF `config.json` contents describing `cfg` as a `model_type` model."""
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(f'model_type {model_type!r} is not supported; supported: '
                     f'{", ".join(SUPPORTED_MODEL_TYPES)}')
  if cfg.qk_norm != (model_type == 'qwen3'):
    raise ValueError(f'a model with qk_norm={cfg.qk_norm} cannot be exported as '
                     f'{model_type!r} (qwen3 has q/k norms, llama has none)')
  return {
      'architectures': [_ARCHITECTURES[model_type]],
      'model_type': model_type,
      'vocab_size': cfg.vocab_size,
      'hidden_size': cfg.embed_dim,
      'intermediate_size': cfg.mlp_dim,
      'num_hidden_layers': cfg.num_layers,
      'num_attention_heads': cfg.num_heads,
      'num_key_value_heads': cfg.num_kv_heads,
      'head_dim': cfg.head_dim,
      'hidden_act': 'silu',
      'rms_norm_eps': cfg.norm_eps,
      'rope_theta': cfg.rope_theta,            # transformers 4
      'rope_parameters': {'rope_type': 'default', 'rope_theta': cfg.rope_theta},  # 5
      'max_position_embeddings': max_position_embeddings,
      'tie_word_embeddings': cfg.tie_embeddings,
      'attention_bias': False,
      'torch_dtype': cfg.param_dtype,
      'bos_token_id': None,
      'eos_token_id': None,
      'use_cache': True,
  }


def hf_state_dict(model: Transformer) -> dict[str, jnp.ndarray]:
  """Params of `model` under their HF names, in HF ([out, in]) layout."""
  tensors = {}
  for name, value in leaf_paths(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items():
    hf_name, transpose = hf_tensor_name(name)
    tensors[hf_name] = value.T if transpose else value
  return tensors


def _default_model_type(cfg: TransformerConfig) -> str:
  return 'qwen3' if cfg.qk_norm else 'llama'


def export_to_hf(model: Transformer, out_dir, model_type: Optional[str] = None, *,
                 max_position_embeddings: int = 32768) -> None:
  """Writes `out_dir/config.json` and `out_dir/model.safetensors` for `transformers`, both
  or neither (`safetensors_io.write_model_dir`: an earlier export is replaced whole, a
  directory holding another model's files refused).

  `model_type` defaults to 'qwen3' for q/k-normed models and 'llama' otherwise.
  """
  model_type = model_type or _default_model_type(model.cfg)
  config = hf_config_dict(model.cfg, model_type,
                          max_position_embeddings=max_position_embeddings)
  tensors = {k: np.asarray(v) for k, v in hf_state_dict(model).items()}
  write_model_dir(out_dir, config, tensors, model.cfg.param_dtype, what='target export')


def to_transformers_model(model: Transformer, model_type: Optional[str] = None):
  """A torch fp32 `Qwen3ForCausalLM` / `LlamaForCausalLM` (eval mode) with `model`'s weights."""
  try:
    import torch
    import transformers
  except ImportError as e:
    raise ImportError("to_transformers_model needs torch and transformers: "
                      "pip install -e '.[hf]'") from e
  model_type = model_type or _default_model_type(model.cfg)
  config = hf_config_dict(model.cfg, model_type)
  config.pop('torch_dtype')
  hf_config = transformers.AutoConfig.for_model(**config)
  hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).to(torch.float32)
  weights = {name: torch.from_numpy(np.array(value, np.float32))
             for name, value in hf_state_dict(model).items()}
  if model.cfg.tie_embeddings:
    weights['lm_head.weight'] = weights['model.embed_tokens.weight']
  hf_model.load_state_dict(weights, strict=True)
  return hf_model.eval()
