"""Published EAGLE-3 drafter formats: vLLM `speculators` and legacy SafeAILab / SpecForge.

speculators form (`speculators_model_type: "eagle3"`, as speculators 0.9.0 saves it):
config.json with the draft layers in `transformer_layer_config` (llama | qwen3, the
latter with q/k norms; read with their class defaults, `read_draft_layers`, so the
'sliding_attention' layers `speculators train` builds by default keep their window),
`draft_vocab_size`, the norm options, and the taps as HF hidden-state indices
`eagle_aux_hidden_state_layer_ids` (index i = the output of layer i-1, 0 the embedding
output; index L is the post-final-norm hidden; null = [2, L//2, L-3]); model.safetensors with
`fc`, `layers.{i}.*` (layer 0 with `hidden_norm` and 2H-wide q/k/v), `norm`, `lm_head`
[V', H] and the vocabulary maps `t2d` [V] bool / `d2t` [V'] (target id = index + d2t).
With `embed_requires_grad` the drafter trained its own embedding: `embed_tokens.weight`
[V, H] is required and drafting embeds with it; otherwise that tensor is the verifier's
frozen copy and is not read (the target's embedding is used).

Legacy form (SafeAILab EAGLE-3, SpecForge): a Llama config.json (`hidden_size`,
`vocab_size` = the target's, `draft_vocab_size`, ...) and tensors named `midlayer.*` for
layer 0; the taps are SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids` when the
config has them, else EAGLE-3's defaults for the target's depth (or given), a tap of the
last layer read after the final norm as HF's hidden_states[L].

Every config field is read or listed as metadata (`config_fields`); any other is refused.

Every format error is one line naming the key or tensor and the file.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import numpy as np
from flax import nnx

from dspec.models.config import TransformerConfig
from dspec.models.eagle3 import Eagle3Config, Eagle3Model, default_target_layer_ids
from dspec.models.formats import dspec_checkpoint
from dspec.models.formats.config_fields import (DECODER_FIELDS, EAGLE_CONFIG_FIELDS,
                                                LEGACY_EAGLE3_FIELDS,
                                                SPECULATORS_COMMON_FIELDS)
from dspec.models.formats.drafter_dir import (ConfigKeys, FormatError, config_keys,
                                              fill_params, read_draft_layers,
                                              read_draft_vocab, read_drafter,
                                              speculators_keys, verifier_depth)
from dspec.models.formats.safetensors_io import (open_safetensors, stored_tensors,
                                                 tensor_files, write_model_dir)

# speculators_model_type -> the fields its config may hold.
SPECULATORS_FIELDS = {'eagle3': SPECULATORS_COMMON_FIELDS | {
    'draft_vocab_size', 'norm_before_residual', 'target_hidden_size',
    'eagle_aux_hidden_state_layer_ids', 'norm_before_fc', 'fc_norm', 'norm_output',
    'embed_requires_grad'}}
_IGNORED = ('embed_tokens.weight', 'verifier_lm_head.weight', 'verifier_norm.weight',
            't2d', 'd2t')
_EMBED = 'embed_tokens.weight'
_NORM_FLAGS = ('norm_before_residual', 'norm_before_fc', 'fc_norm', 'norm_output')


def _layer_shapes(keys: ConfigKeys, depth: int, dtype: str) -> tuple:
  """(TransformerConfig of the draft layers, their config fields: num_layers, layer_types,
  sliding_window)."""
  shapes, n, layer_types, window = read_draft_layers(keys, ('llama', 'qwen3'), depth, dtype,
                                                     num_layers_default=1)
  if 'sliding_attention' not in layer_types:
    layer_types, window = (), None
  return shapes, dict(num_layers=n, layer_types=layer_types, sliding_window=window)


def _check_width(file: str, hidden: int, target_cfg: Optional[TransformerConfig]) -> None:
  if target_cfg is not None and hidden != target_cfg.embed_dim:
    raise FormatError(f'{file}: eagle3 checkpoint hidden size {hidden} does not match the '
                      f'target width {target_cfg.embed_dim}')


def _stored_name(param: str) -> tuple:
  """(speculators tensor name, transposed) of a dotted param path."""
  if param.endswith('.kernel'):
    return param[:-len('kernel')] + 'weight', True
  if param == 'embed_tokens':
    return _EMBED, False
  return param, False


def _build(path: str, cfg_fields: dict, shapes: TransformerConfig, tensors: dict,
           rename=lambda name: name) -> Eagle3Model:
  """The model with every param read from `tensors` {stored name: file}; `rename` maps a
  stored name to speculators' name."""
  file = os.path.join(path, 'config.json')
  ignored = set(_IGNORED) - ({_EMBED} if cfg_fields.get('own_embedding') else set())
  by_name = {rename(name): (f, name) for name, f in tensors.items() if name not in ignored}
  fc = by_name.get('fc.weight')
  n_taps = len(cfg_fields['target_layer_ids'])
  if fc is not None:
    with open_safetensors(fc[0]) as f:
      width = f.get_slice(fc[1]).get_shape()[-1]
    if width != n_taps * shapes.embed_dim:
      raise FormatError(f'{fc[0]}: tensor fc.weight fuses {width // shapes.embed_dim} taps '
                        f'(input width {width}) but the config names {n_taps} tap layers')
  try:
    cfg = Eagle3Config(**cfg_fields)
    model = nnx.eval_shape(lambda: Eagle3Model(cfg, shapes, rngs=nnx.Rngs(0)))
  except (TypeError, ValueError) as e:
    raise FormatError(f'{file}: {e}') from None
  fill_params(model, path, by_name, _stored_name)
  return model


def _vocab(path, keys: ConfigKeys, tensors: dict, vocab: int) -> tuple:
  size = keys.get('draft_vocab_size', int, vocab)
  return read_draft_vocab(path, tensors, vocab, size) if size != vocab else ()


def read_dspec(path, *, target_cfg: Optional[TransformerConfig] = None,
               taps: Optional[Sequence[int]] = None, dtype: str = 'float32') -> Eagle3Model:
  """An EAGLE-3 drafter from a dspec checkpoint (which holds its own configs, taps and
  dtype: the arguments are not read)."""
  del target_cfg, taps, dtype
  return dspec_checkpoint.load(path, Eagle3Model, Eagle3Config)


def read_speculators(path, *, target_cfg: Optional[TransformerConfig] = None,
                     taps: Optional[Sequence[int]] = None,
                     dtype: str = 'float32') -> Eagle3Model:
  """An EAGLE-3 drafter from a speculators directory (`taps` is not read: the config
  names them)."""
  del taps
  spec, _ = speculators_keys(path, SPECULATORS_FIELDS)
  layer = ConfigKeys(spec.get('transformer_layer_config', dict, required=True), spec.file,
                     'transformer_layer_config.')
  layer.check_known(DECODER_FIELDS)
  depth = target_cfg.num_layers if target_cfg is not None else verifier_depth(spec)
  if depth is None:
    raise spec.error('speculators_config.verifier.name_or_path', 'is not a readable '
                     'directory: pass the target config (its depth resolves the taps)')
  shapes, layer_fields = _layer_shapes(layer, depth, dtype)
  vocab = shapes.vocab_size
  _check_width(spec.file, shapes.embed_dim, target_cfg)
  target_hidden = spec.get('target_hidden_size', int)
  if target_hidden not in (None, shapes.embed_dim):
    raise spec.error('target_hidden_size', f'{target_hidden} differs from the draft width '
                     f'{shapes.embed_dim}')
  aux = spec.int_list('eagle_aux_hidden_state_layer_ids') or [2, depth // 2, depth - 3]
  if min(aux) < 0 or max(aux) > depth:
    raise spec.error('eagle_aux_hidden_state_layer_ids', f'{aux} are not hidden-state '
                     f'indices in [0, {depth}] of the {depth}-layer target')
  steps = [m.get('speculative_tokens') for m in (spec.config.get('speculators_config') or {})
           .get('proposal_methods') or [] if isinstance(m, dict)]
  tensors = tensor_files(path)
  fields = dict(target_layer_ids=tuple(a - 1 for a in aux), **layer_fields,
                draft_vocab=_vocab(path, spec, tensors, vocab),
                final_tap_normed=depth in aux,
                ttt_steps=steps[0] if steps and isinstance(steps[0], int) else 3,
                own_embedding=spec.get('embed_requires_grad', bool, False),
                **{k: spec.get(k, bool, False) for k in _NORM_FLAGS})
  return _build(path, fields, shapes, tensors)


def _legacy_taps(keys: ConfigKeys, depth: int, taps: Optional[Sequence[int]]) -> tuple:
  """0-based taps of a legacy checkpoint: SGLang's `eagle_config.eagle_aux_hidden_state_
  layer_ids` (hidden-state indices, as speculators'), else `taps`, else EAGLE-3's defaults;
  a `taps` that disagrees with the config is a FormatError."""
  eagle = keys.nested('eagle_config')
  eagle.check_known(EAGLE_CONFIG_FIELDS)
  if not eagle.get('use_aux_hidden_state', bool, True):
    raise eagle.error('use_aux_hidden_state', 'is false: an EAGLE-3 drafter fuses aux '
                      'hidden states')
  aux = eagle.int_list('eagle_aux_hidden_state_layer_ids')
  if aux is None:
    return tuple(taps) if taps else default_target_layer_ids(depth)
  if not aux or min(aux) < 0 or max(aux) > depth:
    raise eagle.error('eagle_aux_hidden_state_layer_ids', f'{aux} are not hidden-state '
                      f'indices in [0, {depth}] of the {depth}-layer target')
  named = tuple(a - 1 for a in aux)
  if taps and tuple(taps) != named:
    raise eagle.error('eagle_aux_hidden_state_layer_ids', f'{aux} name taps {list(named)}, '
                      f'not the {list(taps)} asked for')
  return named


def read_legacy(path, *, target_cfg: Optional[TransformerConfig] = None,
                taps: Optional[Sequence[int]] = None, dtype: str = 'float32') -> Eagle3Model:
  """An EAGLE-3 drafter from a legacy SafeAILab / SpecForge directory (`midlayer.*`)."""
  keys = config_keys(path)
  tensors = tensor_files(path)
  keys.check_known(LEGACY_EAGLE3_FIELDS)
  if not any(name.startswith('midlayer.') for name in tensors):
    raise FormatError(f'{path}: neither a speculators config (speculators_model_type) nor '
                      'legacy EAGLE-3 tensors (midlayer.*)')
  if target_cfg is None:
    raise FormatError(f'{path}: a legacy EAGLE-3 checkpoint needs the target config (its '
                      'depth gives the taps)')
  shapes, layer_fields = _layer_shapes(keys, target_cfg.num_layers, dtype)
  vocab = shapes.vocab_size
  _check_width(keys.file, shapes.embed_dim, target_cfg)
  depth = target_cfg.num_layers
  taps = _legacy_taps(keys, depth, taps)
  fields = dict(target_layer_ids=taps, final_tap_normed=depth - 1 in taps, **layer_fields,
                draft_vocab=_vocab(path, keys, tensors, vocab),
                **{k: keys.get(k, bool, False) for k in _NORM_FLAGS})
  return _build(path, fields, shapes, tensors,
                rename=lambda n: 'layers.0.' + n[len('midlayer.'):]
                if n.startswith('midlayer.') else n)


READERS = {'dspec': read_dspec, 'speculators': read_speculators, 'legacy': read_legacy}


def load_eagle3(path, *, target_cfg: Optional[TransformerConfig] = None,
                taps: Optional[Sequence[int]] = None, dtype: str = 'float32') -> Eagle3Model:
  """An EAGLE-3 drafter from a dspec checkpoint, a speculators directory or a legacy one.

  target_cfg: the target's config (its depth resolves the taps of an import; its width is
  checked against the checkpoint's); a speculators config can name the depth through a
  readable verifier directory instead. taps: 0-based tap layers of a legacy checkpoint
  (default EAGLE-3's). `dtype`: parameter and compute dtype of imports.
  """
  return read_drafter(path, READERS, target_cfg=target_cfg, taps=taps, dtype=dtype)


# ---------------------------------------------------------------------------- writing


def speculators_config(model: Eagle3Model) -> dict:
  """The speculators config.json of a drafter (as speculators 0.9.0 writes it)."""
  cfg, shapes = model.cfg, model.layer_cfg
  depth = model.target_cfg.num_layers
  aux = [i + 1 for i in cfg.target_layer_ids]
  if depth - 1 in cfg.target_layer_ids and not cfg.final_tap_normed:
    raise ValueError(f'the drafter taps the last target layer ({depth - 1}) before the '
                     'final norm; speculators reads it after')
  layer = dict(
      model_type='qwen3' if shapes.qk_norm else 'llama', hidden_size=shapes.embed_dim,
      num_hidden_layers=cfg.num_layers, num_attention_heads=shapes.num_heads,
      num_key_value_heads=shapes.num_kv_heads, head_dim=shapes.head_dim,
      intermediate_size=shapes.mlp_dim, hidden_act='silu', rms_norm_eps=shapes.norm_eps,
      vocab_size=shapes.vocab_size, attention_bias=False, tie_word_embeddings=False,
      rope_parameters={'rope_theta': shapes.rope_theta, 'rope_type': 'default'},
      layer_types=list(cfg.layer_types) or ['full_attention'] * cfg.num_layers,
      sliding_window=cfg.sliding_window, use_sliding_window=cfg.sliding_window is not None)
  return dict(
      architectures=['Eagle3DraftModel'], speculators_model_type='eagle3',
      speculators_version='0.9.0', draft_vocab_size=model.draft_vocab_size,
      eagle_aux_hidden_state_layer_ids=aux, embed_requires_grad=cfg.own_embedding,
      target_hidden_size=None, tie_word_embeddings=False, transformer_layer_config=layer,
      speculators_config=dict(
          algorithm='eagle3', default_proposal_method='greedy',
          proposal_methods=[dict(proposal_type='greedy', speculative_tokens=cfg.ttt_steps,
                                 accept_tolerance=0.0, verifier_accept_k=1)],
          verifier=dict(architectures=['Qwen3ForCausalLM' if shapes.qk_norm
                                       else 'LlamaForCausalLM'], name_or_path=None)),
      **{k: getattr(cfg, k) for k in _NORM_FLAGS})


def save_speculators(path, model: Eagle3Model, *, dtype: str = 'float32',
                     force: bool = False) -> None:
  """Writes config.json + model.safetensors in speculators form (t2d/d2t included, and
  `embed_tokens.weight` when the drafter has its own embedding); `force`: see
  `write_model_dir`."""
  config = speculators_config(model)
  tensors = stored_tensors(model, _stored_name, dtype)
  if model.cfg.draft_vocab:
    ids = np.asarray(model.cfg.draft_vocab, np.int64)
    t2d = np.zeros((model.target_cfg.vocab_size,), bool)
    t2d[ids] = True
    tensors['t2d'] = t2d
    tensors['d2t'] = np.asarray(ids - np.arange(len(ids)), np.int64)
  write_model_dir(path, config, tensors, dtype, force=force)
