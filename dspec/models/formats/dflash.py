"""Published DFlash / DFlash-2 drafter formats: z-lab `dflash` and vLLM `speculators`.

Both are a directory with `config.json` and safetensors (docs/DESIGN.md, "Checkpoint
formats"); dspec's own checkpoints are orbax directories (`dspec_checkpoint`). `load_dflash`
reads any of the three.

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
Every config field is read or listed as metadata (`config_fields`); any other is refused.
Every format error is one line naming the key or tensor and the file.
"""

from __future__ import annotations

import os
from typing import Optional

from flax import nnx

from dspec.checkpoint import CheckpointError
from dspec.models.config import TransformerConfig
from dspec.models.dflash import DFlashConfig, DFlashModel
from dspec.models.dflash2 import DFlash2Config, DFlash2Model
from dspec.models.formats import dspec_checkpoint
from dspec.models.formats.config_fields import (DFLASH_LAYER_FIELDS,
                                                SPECULATORS_DFLASH_FIELDS, ZLAB_DRAFT_FIELDS,
                                                ZLAB_FIELDS)
from dspec.models.formats.drafter_dir import (ZLAB_ARCHITECTURES, ConfigKeys, FormatError,
                                              config_keys, fill_params, read_draft_layers,
                                              read_draft_vocab, read_drafter,
                                              speculators_keys, verifier_depth)
from dspec.models.formats.safetensors_io import stored_tensors, tensor_files, write_model_dir

# speculators_model_type -> the fields its config may hold.
SPECULATORS_FIELDS = {'dflash': SPECULATORS_DFLASH_FIELDS,
                      'dflash2': SPECULATORS_DFLASH_FIELDS | {
                          'conv_kernel_size', 'conv_group_size', 'selector_rank',
                          'selector_top_k'}}
_CLASSES = {'dflash': (DFlashModel, DFlashConfig), 'dflash2': (DFlash2Model, DFlash2Config)}
_DFLASH2_KEYS = ('conv_kernel_size', 'conv_group_size', 'selector_rank', 'selector_top_k')
# speculators tensors that never belong to the draft body (the verifier's, reloaded).
SPECULATORS_IGNORED = ('embed_tokens.weight', 'verifier_lm_head.weight',
                       'verifier_norm.weight', 'lm_head.weight', 't2d', 'd2t')


def zlab_target_layer_ids(num_target_layers: int, num_layers: int) -> tuple:
  """z-lab's default taps: [L // 2] for one layer, else round(1 + i·(L−4)/(n−1)) with
  Python's rounding, neither clipped nor deduplicated."""
  if num_layers == 1:
    return (num_target_layers // 2,)
  span = num_target_layers - 4
  return tuple(round(1 + i * span / (num_layers - 1)) for i in range(num_layers))


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


# ---------------------------------------------------------------------------- reading


def read_dspec(path, *, num_target_layers: Optional[int] = None, dtype: str = 'float32',
               **overrides) -> DFlashModel:
  """A DFlash or DFlash-2 drafter from a dspec checkpoint (which holds its own configs and
  dtype: `num_target_layers` and `dtype` are not read)."""
  del num_target_layers, dtype
  try:
    return dspec_checkpoint.load(path, DFlash2Model, DFlash2Config, **overrides)
  except CheckpointError as e:
    if "holds a 'dflash' model" not in str(e):
      raise
  return dspec_checkpoint.load(path, DFlashModel, DFlashConfig, **overrides)


def _layer_shapes(keys: ConfigKeys, num_target_layers: int, dtype: str,
                  model_types: tuple = ('qwen3',)) -> tuple:
  """(TransformerConfig of the draft layers with the target's depth, n layers, attention
  fields) from a layer config dict (`read_draft_layers`; DFlash layers always have q/k
  norms, whichever model_type names their config)."""
  shapes, n, layer_types, window = read_draft_layers(keys, model_types, num_target_layers,
                                                     dtype, qk_norm=True)
  attention = dict(layer_types=layer_types, sliding_window=window,
                   is_causal=keys.get('is_causal', bool))
  return shapes, n, attention


def torch_name(dspec_name: str, codebook_suffix: bool) -> tuple:
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


def build_drafter(drafter_class, config_class, path: str, cfg_fields: dict,
                  shapes: TransformerConfig, tensors: dict, overrides: dict):
  """The (abstract) drafter of `cfg_fields` + `overrides` with every param read from
  `tensors` {name: file}; a field the config class refuses is a FormatError."""
  try:
    cfg = config_class(**cfg_fields, **overrides)
    drafter = nnx.eval_shape(lambda: drafter_class(cfg, shapes, rngs=nnx.Rngs(0)))
  except (TypeError, ValueError) as e:
    raise FormatError(f'{os.path.join(path, "config.json")}: {e}') from None

  def locate(dspec_name):
    candidates = [torch_name(dspec_name, True), torch_name(dspec_name, False)]
    return next((c for c in candidates if c[0] in tensors), candidates[0])

  fill_params(drafter, path, {name: (file, name) for name, file in tensors.items()}, locate)
  return drafter


def read_zlab(path, *, num_target_layers: Optional[int] = None, dtype: str = 'float32',
              **overrides) -> DFlashModel:
  """A drafter from a z-lab directory (config.json + model.safetensors)."""
  path = os.fspath(path)
  top = config_keys(path)
  config, file = top.config, top.file
  archs = top.get('architectures', list, required=True)
  kinds = [ZLAB_ARCHITECTURES[a] for a in archs if a in ZLAB_ARCHITECTURES]
  if not kinds:
    raise top.error('architectures', f'names none of {sorted(ZLAB_ARCHITECTURES)}: {archs}')
  kind = kinds[0]
  top.check_known(ZLAB_FIELDS)
  draft = config.get('dflash_config') or {}
  if not isinstance(draft, dict):
    raise top.error('dflash_config', 'must be an object')
  inner = ConfigKeys(draft, file, 'dflash_config.')
  inner.check_known(ZLAB_DRAFT_FIELDS)

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
  return build_drafter(*_CLASSES[kind], path, fields, shapes, tensor_files(path), overrides)


def read_speculators_config(path: str, known: dict, num_target_layers: Optional[int],
                            dtype: str) -> tuple:
  """What every DFlash-family speculators config holds: (its ConfigKeys, its kind, the
  draft layers' TransformerConfig, the config fields of the layers, block, taps, mask
  token and attention); `known` as `speculators_keys`'s `fields`."""
  spec, kind = speculators_keys(path, known)
  depth = num_target_layers or verifier_depth(spec)
  if depth is None:
    raise spec.error('speculators_config.verifier.name_or_path', 'is not a readable '
                     'directory: pass num_target_layers (the target depth)')
  layer = ConfigKeys(spec.get('transformer_layer_config', dict, required=True), spec.file,
                     'transformer_layer_config.')
  layer.check_known(DFLASH_LAYER_FIELDS)
  shapes, n, attention = _layer_shapes(layer, depth, dtype, ('qwen3', 'llama'))
  target_hidden = spec.get('target_hidden_size', int)
  if target_hidden not in (None, shapes.embed_dim):
    raise spec.error('target_hidden_size', f'{target_hidden} differs from the draft width '
                     f'{shapes.embed_dim}')
  aux = spec.int_list('aux_hidden_state_layer_ids', required=True)
  if not aux or min(aux) < 1:
    raise spec.error('aux_hidden_state_layer_ids', f'must be hidden-state indices >= 1, '
                     f'got {aux}')
  fields = dict(num_layers=n, block_size=spec.get('block_size', int, 8),
                target_layer_ids=tuple(a - 1 for a in aux),
                mask_token_id=spec.get('mask_token_id', int, required=True),
                final_tap_normed=True, **attention)
  return spec, kind, shapes, fields


def read_speculators(path, *, num_target_layers: Optional[int] = None,
                     dtype: str = 'float32', **overrides) -> DFlashModel:
  """A drafter from a speculators directory (speculators_model_type dflash | dflash2)."""
  path = os.fspath(path)
  spec, kind, shapes, fields = read_speculators_config(path, SPECULATORS_FIELDS,
                                                       num_target_layers, dtype)
  if spec.get('sample_from_anchor', bool, False):
    raise spec.error('sample_from_anchor', 'is true (anchor-predicting blocks are not '
                     'DFlash)')
  if spec.get('sliding_window_non_causal', bool, kind == 'dflash2'):
    fields['is_causal'] = False
  tensors = tensor_files(path)
  vocab_size = spec.get('draft_vocab_size', int, shapes.vocab_size)
  if vocab_size != shapes.vocab_size:
    fields['draft_vocab'] = read_draft_vocab(path, tensors, shapes.vocab_size, vocab_size)
  if kind == 'dflash2':
    defaults = dict(zip(_DFLASH2_KEYS, (2, 16, 256, 16)))
    fields.update({k: spec.get(k, int, defaults[k]) for k in _DFLASH2_KEYS})
  tensors = {k: v for k, v in tensors.items() if k not in SPECULATORS_IGNORED}
  return build_drafter(*_CLASSES[kind], path, fields, shapes, tensors, overrides)


READERS = {'dspec': read_dspec, 'zlab': read_zlab, 'speculators': read_speculators}


def load_dflash(path, *, num_target_layers: Optional[int] = None,
                target_cfg: Optional[TransformerConfig] = None, dtype: str = 'float32',
                **overrides) -> DFlashModel:
  """A DFlash / DFlash-2 drafter from a dspec checkpoint or a z-lab / speculators directory
  (`drafter_dir.detect`).

  num_target_layers: the target's depth (default: that of `target_cfg`, the target's
  config); checked against a z-lab config, needed by a speculators config whose verifier
  directory is not readable. `overrides` replace config fields (e.g. attention_impl);
  `dtype` is the parameter and compute dtype of imports.
  """
  if num_target_layers is None and target_cfg is not None:
    num_target_layers = target_cfg.num_layers
  return read_drafter(path, READERS, num_target_layers=num_target_layers, dtype=dtype,
                      **overrides)


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


def save_zlab(path, drafter: DFlashModel, *, dtype: str = 'float32',
              force: bool = False) -> None:
  """Writes `config.json` + `model.safetensors` in z-lab form (loadable by
  `dflash.DFlashDraftModel` / `DFlash2DraftModel.from_pretrained`); `force`: see
  `write_model_dir`."""
  tensors = stored_tensors(drafter, lambda name: torch_name(name, True), dtype)
  write_model_dir(path, zlab_config(drafter), tensors, dtype, force=force)
