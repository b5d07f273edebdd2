"""Import Hugging Face Llama / Qwen3 checkpoints (config.json + safetensors) into dspec.

dspec parameter names mirror HF, so the mapping is mechanical (`hf_tensor_name`):
`layers.3.mlp.up_proj.kernel` <-> `model.layers.3.mlp.up_proj.weight` (transposed: nnx
kernels are [in, out], torch weights [out, in]); `embed_tokens` <-> `model.embed_tokens.weight`;
`lm_head` [D, V] <-> `lm_head.weight` [V, D] (absent when embeddings are tied).
MTP layers `model.layers.{L..L+n-1}.*` of a checkpoint with `num_nextn_predict_layers` = n
(DeepSeek-V3 layout) are not the target's: the MTP drafter reads them
(`dspec.models.formats.mtp`).
"""

from __future__ import annotations

import json
import os

from flax import nnx

from dspec.checkpoint import leaf_paths
from dspec.config_checks import check_stored_config
from dspec.errors import UserError
from dspec.models.config import TransformerConfig
from dspec.models.formats.hf_config import config_from_hf
from dspec.models.formats.safetensors_io import read_params, tensor_files
from dspec.models.transformer import Transformer


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


def read_hf_config(hf_dir) -> dict:
  """The parsed `config.json` of a HF model directory (its numbers finite and in range:
  `config_checks.check_stored_config`)."""
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
  except OSError as e:
    raise ValueError(f'{path}: cannot be read ({e.strerror or e})') from None
  if not isinstance(config, dict):
    raise ValueError(f'{path}: must hold a JSON object, got {type(config).__name__}')
  try:
    check_stored_config(config)
  except UserError as e:
    raise ValueError(f'{path}: {e}') from None
  return config


def load_hf_model(hf_dir, dtype: str = 'float32') -> tuple[Transformer, TransformerConfig]:
  """Builds a Transformer from a HF Llama/Qwen3 directory (single or sharded safetensors).

  Any missing, unexpected or mis-shaped tensor raises ValueError naming it.
  """
  hf_dir = os.fspath(hf_dir)
  hf_config = read_hf_config(hf_dir)
  try:
    cfg = config_from_hf(hf_config, dtype)
  except ValueError as e:
    raise ValueError(f'{os.path.join(hf_dir, "config.json")}: {e}') from None
  nextn = hf_config.get('num_nextn_predict_layers')
  mtp_layers = tuple(f'model.layers.{cfg.num_layers + k}.'
                     for k in range(nextn if isinstance(nextn, int) else 0))
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  files = tensor_files(hf_dir)
  wanted = {hf_tensor_name(name)[0]
            for name in leaf_paths(nnx.to_pure_dict(nnx.state(model, nnx.Param)))}
  extra = sorted(n for n in files if n not in wanted and not _ignorable(n, cfg)
                 and not n.startswith(mtp_layers))
  if extra:
    raise ValueError(f'{hf_dir}: unexpected tensor {extra[0]!r} '
                     f'({len(extra)} tensors the {cfg.num_layers}-layer config does not use)')
  read_params(model, {name: (file, name) for name, file in files.items()}, hf_tensor_name,
              hf_dir)
  return model, cfg
