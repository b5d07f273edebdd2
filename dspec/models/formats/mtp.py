"""Published MTP formats: speculators `mtp` and HF checkpoints with DeepSeek-V3 MTP layers.

Both map onto dspec's chained `MTP` (emb-first concat, post-final-norm h^0, post-norm
hidden chained to the next step, no position-0 embedding zeroing); every format error is
one line naming the key or tensor and the file.

speculators form (`speculators_model_type: "mtp"`, as speculators 0.9.0 saves it):
config.json with the verifier's config in `transformer_layer_config` (its
`num_hidden_layers` is the target's depth; h^0 is the verifier's last, post-norm hidden
state), `num_nextn_predict_layers` (1) and the trained step count in
`speculators_config.proposal_methods[0].speculative_tokens`; model.safetensors with
`mtp_layers.0.{token_layernorm, hidden_layernorm, input_proj, <decoder layer>,
final_layernorm}`. Its one layer runs every step (FastMTP): x = Layer(input_proj(
[token_layernorm(emb(t_{i+k})) ; hidden_layernorm(h)])), h' = final_layernorm(x),
logits = lm_head(h'), h' chained. That is a `shared_depth` MTP whose num_depths is the
step count (at most 4; `num_draft` may recurse further). Embedding and head are the
verifier's (not stored; `verifier_lm_head.weight` is ignored).

DeepSeek-V3 layout (a HF checkpoint whose config.json has `num_nextn_predict_layers` = D,
README_WEIGHTS.md of deepseek-ai/DeepSeek-V3): depth k is `model.layers.{L+k-1}`
(L = `num_hidden_layers`) with `enorm`, `hnorm`, `eh_proj` [H, 2H] (embedding first), a
decoder block, `shared_head.norm` (the depth's final norm) and, optionally, `embed_tokens`
and `shared_head.head`. DeepSeek-V3 ships those two as copies of the main model's: when
they equal the main `model.embed_tokens.weight` / `lm_head.weight` of the same directory
the target's are used; otherwise (or when the main tensors are not there) every depth
reads its own (`own_embedding` / `own_head`). One depth (DeepSeek-V3's D = 1) becomes a
shared depth, so `num_draft` may recurse it as vLLM and SGLang do. Only dense Llama /
Qwen3 blocks are supported (config.json model_type llama | qwen3, shapes as the target's
HF import): DeepSeek-V3's MLA attention (`kv_a_proj_with_mqa`, `q_a_proj`, ...) and MoE
MLPs (`experts`, `gate`, `shared_experts`) are a FormatError naming the tensor. The same
directory loads as the target (`hf_import` skips the MTP layers).
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np
from flax import nnx

from dspec.models.config import TransformerConfig
from dspec.models.formats import dspec_checkpoint
from dspec.models.formats.config_fields import SPECULATORS_COMMON_FIELDS
from dspec.models.formats.drafter_dir import (ConfigKeys, FormatError, config_keys,
                                              fill_params, read_drafter, speculators_keys)
from dspec.models.formats.hf_config import config_from_hf
from dspec.models.formats.safetensors_io import (read_tensor, stored_tensors, tensor_files,
                                                 write_model_dir)
from dspec.models.mtp import MTP, MTPConfig

# speculators_model_type -> the fields its config may hold.
SPECULATORS_FIELDS = {'mtp': SPECULATORS_COMMON_FIELDS | {'num_nextn_predict_layers'}}
# Per-depth (non-block) leaves: dspec name -> (stored name, transposed).
_DEEPSEEK_LEAVES = {
    'enorm.weight': ('enorm.weight', False), 'hnorm.weight': ('hnorm.weight', False),
    'eh_proj.kernel': ('eh_proj.weight', True),
    'final_norm.weight': ('shared_head.norm.weight', False),
    'embed_tokens': ('embed_tokens.weight', False), 'head': ('shared_head.head.weight', True)}
_SPECULATORS_LEAVES = {
    'enorm.weight': ('token_layernorm.weight', False),
    'hnorm.weight': ('hidden_layernorm.weight', False),
    'eh_proj.kernel': ('input_proj.weight', True),
    'final_norm.weight': ('final_layernorm.weight', False)}
_SPECULATORS_PREFIX = 'mtp_layers.0.'
_SPECULATORS_IGNORED = ('embed_tokens.weight', 'lm_head.weight', 'verifier_lm_head.weight',
                        't2d', 'd2t')
# Name parts of DeepSeek-V3 MLA attention and MoE MLP tensors.
_UNSUPPORTED_PARTS = ('q_a_proj', 'q_a_layernorm', 'q_b_proj', 'kv_a_proj_with_mqa',
                      'kv_a_layernorm', 'kv_b_proj', 'experts', 'shared_experts', 'gate',
                      'e_score_correction_bias')


# ---------------------------------------------------------------------------- reading


def _shapes(keys: ConfigKeys, target_cfg, dtype: str) -> TransformerConfig:
  """The target-shaped TransformerConfig of an HF config dict (the MTP block's shapes)."""
  try:
    shapes = config_from_hf(keys.config, dtype)
  except ValueError as e:
    where = f' (in {keys.prefix[:-1]})' if keys.prefix else ''
    raise FormatError(f'{keys.file}: {e}{where}') from None
  if target_cfg is not None and shapes.embed_dim != target_cfg.embed_dim:
    raise FormatError(f'{keys.file}: mtp checkpoint hidden size {shapes.embed_dim} does not '
                      f'match the target width {target_cfg.embed_dim}')
  return shapes


def _build(path: str, cfg: MTPConfig, shapes: TransformerConfig, tensors: dict,
           stored_name) -> MTP:
  """The MTP with every param read from `tensors` {stored name: file}; `stored_name` maps
  a param path to (stored name, transposed). Tensors the model does not read are an
  error."""
  try:
    model = nnx.eval_shape(lambda: MTP(cfg, shapes, rngs=nnx.Rngs(0)))
  except ValueError as e:
    raise FormatError(f'{os.path.join(path, "config.json")}: {e}') from None
  fill_params(model, path, {name: (file, name) for name, file in tensors.items()},
              stored_name)
  return model


def _namer(prefix_of, leaves: dict):
  """stored_name(param path) -> (stored name, transposed): `prefix_of(depth module
  index)` + the block's HF name or the name `leaves` gives a per-depth leaf."""
  def stored_name(param: str) -> tuple:
    _, j, leaf_name = param.split('.', 2)
    prefix = prefix_of(int(j))
    if leaf_name.startswith('layer.'):
      rest = leaf_name[len('layer.'):]
      if rest.endswith('.kernel'):
        return prefix + rest[:-len('kernel')] + 'weight', True
      return prefix + rest, False
    name, transpose = leaves[leaf_name]
    return prefix + name, transpose
  return stored_name


_speculators_name = _namer(lambda j: _SPECULATORS_PREFIX, _SPECULATORS_LEAVES)


def read_dspec(path, *, target_cfg: Optional[TransformerConfig] = None,
               dtype: str = 'float32') -> MTP:
  """An MTP from a dspec checkpoint (which holds its own configs and dtype: the arguments
  are not read)."""
  del target_cfg, dtype
  return dspec_checkpoint.load(path, MTP, MTPConfig)


def read_speculators(path, *, target_cfg: Optional[TransformerConfig] = None,
                     dtype: str = 'float32') -> MTP:
  """An MTP from a speculators `mtp` directory."""
  spec, _ = speculators_keys(path, SPECULATORS_FIELDS)
  layers = spec.get('num_nextn_predict_layers', int, 1)
  if layers != 1:
    raise spec.error('num_nextn_predict_layers', f'must be 1 (speculators\' MTP has one '
                     f'layer), got {layers}')
  layer = ConfigKeys(spec.get('transformer_layer_config', dict, required=True), spec.file,
                     'transformer_layer_config.')
  shapes = _shapes(layer, target_cfg, dtype)
  methods = (spec.get('speculators_config', dict) or {}).get('proposal_methods') or [{}]
  first = methods[0] if isinstance(methods, list) else None
  steps = first.get('speculative_tokens', 3) if isinstance(first, dict) else None
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    raise spec.error('speculators_config.proposal_methods[0].speculative_tokens',
                     f'must be a positive integer, got {steps!r}')
  cfg = MTPConfig(num_depths=min(steps, 4), shared_depth=True)
  tensors = {name: file for name, file in tensor_files(path).items()
             if name not in _SPECULATORS_IGNORED}
  return _build(path, cfg, shapes, tensors, _speculators_name)


def _same_tensor(tensors: dict, a: str, b: str) -> bool:
  x, y = read_tensor(tensors[a], a, FormatError), read_tensor(tensors[b], b, FormatError)
  return x.shape == y.shape and np.array_equal(x, y)


def _own(tensors: dict, names: list, main: Optional[str]) -> bool:
  """Whether the depths' copies `names` are their own: present and not all equal to the
  main model's tensor `main` (None when the directory lacks it)."""
  present = [n for n in names if n in tensors]
  if not present:
    return False
  if len(present) != len(names):
    missing = sorted(set(names) - set(present))[0]
    raise FormatError(f'{tensors[present[0]]}: tensor {missing!r} is missing (the other '
                      'MTP layers carry their own copy)')
  return main not in tensors or not all(_same_tensor(tensors, n, main) for n in names)


def read_deepseek(path, *, target_cfg: Optional[TransformerConfig] = None,
                  dtype: str = 'float32') -> MTP:
  """An MTP from the DeepSeek-V3-layout MTP layers of a HF checkpoint."""
  keys = config_keys(path)
  depth = keys.get('num_hidden_layers', int, required=True)
  n = keys.get('num_nextn_predict_layers', int, required=True)
  if not 1 <= n <= 4:
    raise keys.error('num_nextn_predict_layers', f'must be in 1..4, got {n}')
  prefixes = tuple(f'model.layers.{depth + j}.' for j in range(n))
  all_tensors = tensor_files(path)
  tensors = {name: file for name, file in all_tensors.items() if name.startswith(prefixes)}
  for name in sorted(tensors):
    bad = [p for p in name.split('.') if p in _UNSUPPORTED_PARTS]
    if bad:
      raise FormatError(f'{tensors[name]}: tensor {name!r} ({bad[0]}) is an MLA attention or '
                        'MoE tensor: dspec MTP depths are dense Llama/Qwen3 blocks '
                        '(DeepSeek-V3 MLA and MoE blocks are not supported)')
  shapes = _shapes(keys, target_cfg, dtype)
  main_head = 'lm_head.weight'
  if shapes.tie_embeddings and main_head not in all_tensors:
    main_head = 'model.embed_tokens.weight'
  main = {k: v for k, v in all_tensors.items()
          if k in ('model.embed_tokens.weight', main_head)}
  own_embedding = _own({**tensors, **main}, [p + 'embed_tokens.weight' for p in prefixes],
                       'model.embed_tokens.weight')
  own_head = _own({**tensors, **main}, [p + 'shared_head.head.weight' for p in prefixes],
                  main_head)
  shared = [p + name for p in prefixes for name, keep in
            (('embed_tokens.weight', own_embedding), ('shared_head.head.weight', own_head))
            if not keep]
  tensors = {k: v for k, v in tensors.items() if k not in shared}
  cfg = MTPConfig(num_depths=n, shared_depth=n == 1, own_embedding=own_embedding,
                  own_head=own_head)
  return _build(path, cfg, shapes, tensors,
                _namer(lambda j: prefixes[j], _DEEPSEEK_LEAVES))


READERS = {'dspec': read_dspec, 'speculators': read_speculators, 'deepseek': read_deepseek}


def load_mtp(path, *, target_cfg: Optional[TransformerConfig] = None,
             dtype: str = 'float32') -> MTP:
  """An MTP from a dspec checkpoint, a speculators `mtp` directory or a HF checkpoint with
  DeepSeek-V3-layout MTP layers. target_cfg: the target's config, whose width is checked
  against an import's; `dtype`: parameter and compute dtype of imports."""
  return read_drafter(path, READERS, target_cfg=target_cfg, dtype=dtype)


# ---------------------------------------------------------------------------- writing


def speculators_config(mtp: MTP) -> dict:
  """The speculators config.json of an MTP (ValueError when speculators' one-layer,
  Qwen3, full-vocabulary MTP cannot express it)."""
  cfg, t = mtp.cfg, mtp.target_cfg
  differs = [name for name, ok in (
      ('kind', cfg.chained), ('concat_order', cfg.concat_order == 'emb_first'),
      ('h0_source', cfg.h0_source == 'post_norm'),
      ('chain_hidden', cfg.chain_hidden == 'post_norm'),
      ('zero_pos0_embedding', not cfg.zero_pos0_embedding),
      ('share_final_norm', not cfg.share_final_norm),
      ('shared_depth', cfg.shared_depth or cfg.num_depths == 1),
      ('draft_vocab', not cfg.draft_vocab), ('own_embedding', not cfg.own_embedding),
      ('own_head', not cfg.own_head), ('qk_norm', t.qk_norm)) if not ok]
  if differs:
    raise ValueError(f'mtp {differs[0]}={getattr(cfg, differs[0], False)!r} has no '
                     'speculators form (one shared Qwen3 layer, emb-first, post-norm, full '
                     'vocabulary, the verifier\'s embedding and head)')
  layer = dict(
      model_type='qwen3', hidden_size=t.embed_dim, num_hidden_layers=t.num_layers,
      num_attention_heads=t.num_heads, num_key_value_heads=t.num_kv_heads,
      head_dim=t.head_dim, intermediate_size=t.mlp_dim, hidden_act='silu',
      rms_norm_eps=t.norm_eps, vocab_size=t.vocab_size, attention_bias=False,
      tie_word_embeddings=t.tie_embeddings, use_sliding_window=False,
      rope_parameters={'rope_theta': t.rope_theta, 'rope_type': 'default'},
      layer_types=['full_attention'] * t.num_layers)
  return dict(
      architectures=['MTPDraftModel'], speculators_model_type='mtp',
      speculators_version='0.9.0', num_nextn_predict_layers=1, tie_word_embeddings=False,
      transformer_layer_config=layer,
      speculators_config=dict(
          algorithm='mtp', default_proposal_method='greedy',
          proposal_methods=[dict(proposal_type='greedy', speculative_tokens=cfg.num_depths,
                                 accept_tolerance=0.0, verifier_accept_k=1)],
          verifier=dict(architectures=['Qwen3ForCausalLM'], name_or_path=None)))


def save_speculators(path, mtp: MTP, *, dtype: str = 'float32',
                     force: bool = False) -> None:
  """Writes config.json + model.safetensors in speculators `mtp` form; `force`: see
  `write_model_dir`."""
  write_model_dir(path, speculators_config(mtp), stored_tensors(mtp, _speculators_name, dtype),
                  dtype, force=force)
