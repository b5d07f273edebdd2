"""speculators' DSpark drafter format, and DSpark's dspec checkpoints.

speculators form: config.json with `speculators_model_type: "dspark"`, `markov_rank`,
`markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`,
`sample_from_anchor` and the DFlash keys of `formats.dflash`'s speculators form; tensors
`markov_head.markov_w1.weight` [V, r], `markov_head.markov_w2.weight` [V, r],
`markov_head.gate_proj.{weight,bias}`, `markov_head.joint_proj.{weight,bias}`,
`confidence_head.proj.{weight,bias}` beside the DFlash body. A reduced draft vocabulary
(`draft_vocab_size` < the layers' vocab_size, with `t2d` / `d2t`) is read as DFlash's: W2
and the head cover the draft ids, W1 the target's. The draft layers' config may name
llama or qwen3 (speculators builds Qwen3 DFlash layers, with q/k norms, from either). dspec writes the calibration
as the extra keys `dspec_confidence_temperatures` / `dspec_greedy_confidence_temperatures`.
"""

from __future__ import annotations

import os
from typing import Optional

from dspec.checkpoint import CheckpointError
from dspec.models.config import TransformerConfig
from dspec.models.dspark import DSparkConfig, DSparkModel
from dspec.models.formats import dspec_checkpoint
from dspec.models.formats.config_fields import SPECULATORS_DFLASH_FIELDS
from dspec.models.formats.dflash import (SPECULATORS_IGNORED, build_drafter,
                                         check_exportable, qwen3_layer_config,
                                         read_speculators_config, torch_name)
from dspec.models.formats.drafter_dir import FormatError, read_draft_vocab, read_drafter
from dspec.models.formats.safetensors_io import stored_tensors, tensor_files, write_model_dir

# speculators_model_type -> the fields its config may hold.
SPECULATORS_FIELDS = {'dspark': SPECULATORS_DFLASH_FIELDS | {
    'markov_rank', 'markov_head_type', 'enable_confidence_head', 'confidence_head_with_markov',
    'dspec_confidence_temperatures', 'dspec_greedy_confidence_temperatures'}}
_HEAD_KEYS = {'markov_head': 'markov_rank', 'confidence_head': 'enable_confidence_head'}


# ------------------------------------------------------------------------ reading


def read_dspec(path, *, num_target_layers: Optional[int] = None, dtype: str = 'float32',
               **overrides) -> DSparkModel:
  """A DSpark drafter from a dspec checkpoint (which holds its own configs and dtype:
  `num_target_layers` and `dtype` are not read). A head its config asks for but the
  checkpoint lacks is a FormatError."""
  del num_target_layers, dtype
  try:
    return dspec_checkpoint.load(path, DSparkModel, DSparkConfig, **overrides)
  except CheckpointError as e:
    for head, key in _HEAD_KEYS.items():
      if f"leaf '{head}." in str(e):
        raise FormatError(f'{path}: the {head} weights are missing but its config '
                          f'{key} asks for that head') from None
    raise


def read_speculators(path, *, num_target_layers: Optional[int] = None,
                     dtype: str = 'float32', **overrides) -> DSparkModel:
  """A DSpark drafter from a speculators directory (speculators_model_type dspark)."""
  path = os.fspath(path)
  spec, _, shapes, fields = read_speculators_config(path, SPECULATORS_FIELDS,
                                                    num_target_layers, dtype)
  tensors = tensor_files(path)
  vocab_size = spec.get('draft_vocab_size', int, shapes.vocab_size)
  if vocab_size != shapes.vocab_size:
    fields['draft_vocab'] = read_draft_vocab(path, tensors, shapes.vocab_size, vocab_size)
  if spec.get('sliding_window_non_causal', bool, False):
    fields['is_causal'] = False
  fields.update(
      markov_rank=spec.get('markov_rank', int, 256),
      markov_head_type=spec.config.get('markov_head_type', 'vanilla'),
      enable_confidence_head=spec.get('enable_confidence_head', bool, True),
      confidence_head_with_markov=spec.get('confidence_head_with_markov', bool, True),
      sample_from_anchor=spec.get('sample_from_anchor', bool, True),
      confidence_temperatures=tuple(spec.get('dspec_confidence_temperatures', list, [])),
      greedy_confidence_temperatures=tuple(
          spec.get('dspec_greedy_confidence_temperatures', list, [])))
  tensors = {k: v for k, v in tensors.items() if k not in SPECULATORS_IGNORED}
  wanted = {'markov_head': fields['markov_rank'] > 0,
            'confidence_head': fields['enable_confidence_head']}
  for head, on in wanted.items():
    has = any(k.startswith(head + '.') for k in tensors)
    if on and not has:
      raise FormatError(f'{path}: the {head} tensors are missing but config.json '
                        f'{_HEAD_KEYS[head]} asks for that head')
    if has and not on:
      raise FormatError(f'{path}: {head} tensors are present but config.json '
                        f'{_HEAD_KEYS[head]} turns that head off')
  return build_drafter(DSparkModel, DSparkConfig, path, fields, shapes, tensors, overrides)


READERS = {'dspec': read_dspec, 'speculators': read_speculators}


def load_dspark(path, *, num_target_layers: Optional[int] = None,
                target_cfg: Optional[TransformerConfig] = None, dtype: str = 'float32',
                **overrides) -> DSparkModel:
  """A DSpark drafter from a dspec checkpoint or a speculators directory; arguments as
  `formats.dflash.load_dflash`'s."""
  if num_target_layers is None and target_cfg is not None:
    num_target_layers = target_cfg.num_layers
  return read_drafter(path, READERS, num_target_layers=num_target_layers, dtype=dtype,
                      **overrides)


# ------------------------------------------------------------------------ writing


def speculators_config(drafter: DSparkModel) -> dict:
  """speculators' DSpark config.json of a drafter (ValueError when it has no such form)."""
  cfg, shapes = drafter.cfg, drafter.layer_cfg
  check_exportable(drafter, 'speculators')
  if cfg.draft_vocab:
    raise ValueError("a reduced draft vocabulary has no speculators DSpark export here: that "
                     "form carries the target's head rows (lm_head.weight), which the "
                     'drafter does not hold')
  layer_types = list(cfg.layer_types) or ['full_attention'] * cfg.num_layers
  sliding_causal = cfg.is_causal is None or cfg.is_causal
  if cfg.is_causal and 'full_attention' in layer_types:
    raise ValueError('causal full-attention layers have no speculators form')
  layer = qwen3_layer_config(drafter, layer_types)
  config = dict(
      speculators_model_type='dspark', architectures=['DSparkSpeculator'],
      transformer_layer_config=layer, draft_vocab_size=shapes.vocab_size,
      block_size=cfg.block_size,
      aux_hidden_state_layer_ids=[i + 1 for i in cfg.target_layer_ids],
      mask_token_id=cfg.mask_token_id, target_hidden_size=None,
      sliding_window_non_causal=not sliding_causal,
      sample_from_anchor=cfg.sample_from_anchor,
      markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head_type,
      enable_confidence_head=cfg.enable_confidence_head,
      confidence_head_with_markov=cfg.confidence_head_with_markov,
      speculators_config={
          'algorithm': 'dspark', 'default_proposal_method': 'greedy',
          'proposal_methods': [{'proposal_type': 'greedy',
                                'speculative_tokens': cfg.num_drafts}],
          'verifier': {'name_or_path': None, 'architectures': []}},
      speculators_version='0.9.0', tie_word_embeddings=False)
  if cfg.confidence_temperatures:
    config['dspec_confidence_temperatures'] = list(cfg.confidence_temperatures)
  if cfg.greedy_confidence_temperatures:
    config['dspec_greedy_confidence_temperatures'] = list(cfg.greedy_confidence_temperatures)
  return config


def save_speculators(path, drafter: DSparkModel, *, dtype: str = 'float32',
                     force: bool = False) -> None:
  """Writes `config.json` + `model.safetensors` in speculators' DSpark form; `force`: see
  `write_model_dir`."""
  tensors = stored_tensors(drafter, lambda name: torch_name(name, False), dtype)
  write_model_dir(path, speculators_config(drafter), tensors, dtype, force=force)
