"""Range checks for config values, so bad numbers fail early with one line naming the field.

Every check raises `errors.UserError` (a one-line `error:` at the command line). Integers
must fit int32 (they end up in int32 device arrays or numpy seeds); floats must be finite.
"""

from __future__ import annotations

import difflib
import functools
import math
from typing import Optional, Sequence

from dspec.errors import UserError

INT32_LIMIT = 2 ** 31


def check_int(value, name: str, low: int = 0, high: int = INT32_LIMIT - 1) -> int:
  """`value` as an int in [low, high] (bools and non-integral numbers are refused)."""
  if isinstance(value, bool) or not isinstance(value, int):
    if isinstance(value, float) and value.is_integer():
      value = int(value)
    else:
      raise UserError(f'{name} must be an integer, got {value!r}')
  if not low <= value <= high:
    raise UserError(f'{name} must be in [{low}, {high}], got {value}')
  return value


def check_float(value, name: str, low: float = -math.inf, high: float = math.inf, *,
                low_open: bool = False, high_open: bool = False) -> float:
  """`value` as a finite float in the range (open or closed at either end)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise UserError(f'{name} must be a number, got {value!r}')
  value = float(value)
  if not math.isfinite(value):
    raise UserError(f'{name} must be a finite number, got {value}')
  too_low = value <= low if low_open else value < low
  too_high = value >= high if high_open else value > high
  if too_low or too_high:
    lo, hi = '(' if low_open else '[', ')' if high_open else ']'
    raise UserError(f'{name} must be in {lo}{low:g}, {high:g}{hi}, got {value:g}')
  return value


def check_sampling(cfg, prefix: str = '') -> None:
  """temperature >= 0, top_p in (0, 1], top_k >= 0 and seed in [0, 2**31), all finite."""
  check_float(cfg.temperature, f'{prefix}temperature', 0.0)
  check_float(cfg.top_p, f'{prefix}top_p', 0.0, 1.0, low_open=True)
  check_int(cfg.top_k, f'{prefix}top_k')
  check_int(cfg.seed, f'{prefix}seed')


def check_decode_config(cfg) -> None:
  """The top-level decode fields of the CLI contract (docs/DESIGN.md): sampling, lengths, batch."""
  check_sampling(cfg)
  check_int(cfg.max_new_tokens, 'max_new_tokens', 1)
  check_int(cfg.batch_size, 'batch_size', 1)
  check_int(cfg.model.max_seq_len, 'model.max_seq_len', 2)
  check_int(cfg.model.get('widen_mlp', 1), 'model.widen_mlp', 1)
  if cfg.get('timing_repeats') is not None:
    check_int(cfg.timing_repeats, 'timing_repeats', 0)
  if cfg.get('prompt_index') is not None:
    check_int(cfg.prompt_index, 'prompt_index')


def check_prompt_index(index, num_prompts: int, prompt_set: str) -> int:
  """`index` as a valid position in a prompt set of `num_prompts` (no negative indexing)."""
  index = check_int(index, 'prompt_index')
  if index >= num_prompts:
    raise UserError(f'prompt_index={index} is out of range: prompt set {prompt_set!r} has '
                    f'{num_prompts} prompts (0..{num_prompts - 1})')
  return index


def check_prompts(prompts: Optional[Sequence], batch_size: int) -> None:
  """Refuses more command-line prompts than batch rows (they would be dropped)."""
  if prompts and len(prompts) > batch_size:
    raise UserError(f'{len(prompts)} prompts given but batch_size={batch_size}; set '
                    f'--config.batch_size={len(prompts)} (fewer prompts are repeated to '
                    'fill the batch)')


def check_training_config(tcfg) -> None:
  """The `training` section: step counts, intervals, optimiser numbers, seeds."""
  check_int(tcfg.num_steps, 'training.num_steps', 1)
  for name in ('batch_size', 'seq_len'):
    if tcfg.get(name) is not None:
      check_int(tcfg[name], f'training.{name}', 1)
  for name in ('log_every', 'eval_every', 'ckpt_every'):
    check_int(tcfg[name], f'training.{name}', 1)
  for name in ('export_every', 'eval_windows'):
    if tcfg.get(name) is not None:
      check_int(tcfg[name], f'training.{name}', 0)
  check_int(tcfg.seed, 'training.seed')
  check_float(tcfg.learning_rate, 'training.learning_rate', 0.0)
  check_float(tcfg.warmup_ratio, 'training.warmup_ratio', 0.0, 1.0)
  if tcfg.get('decay_ratio') is not None:
    check_float(tcfg.decay_ratio, 'training.decay_ratio', 0.0, 1.0, low_open=True)
  check_float(tcfg.weight_decay, 'training.weight_decay', 0.0)
  check_float(tcfg.grad_clip, 'training.grad_clip', 0.0, low_open=True)
  for name in ('b1', 'b2'):
    check_float(tcfg[name], f'training.{name}', 0.0, 1.0, high_open=True)
  check_float(tcfg.get('max_minutes') or 0.0, 'training.max_minutes', 0.0)
  storage_dtype = tcfg.get('storage_dtype')
  if storage_dtype is not None and storage_dtype not in ('float32', 'bfloat16'):
    raise UserError(f"training.storage_dtype must be 'float32' or 'bfloat16', got "
                    f'{storage_dtype!r}')
  mixture = tcfg.get('mixture')
  if mixture is not None:
    for name, weight in mixture.items():
      check_float(weight, f'training.mixture.{name}', 0.0)
    if not mixture or sum(mixture.values()) <= 0:
      raise UserError('training.mixture needs at least one corpus with a positive weight')


def check_distill_config(cfg) -> None:
  """The sampling knobs and the `distill` section of a distillation config."""
  check_sampling(cfg)
  dcfg = cfg.distill
  for name in ('batch_size', 'max_new_tokens', 'shard_size', 'max_prompt_tokens'):
    check_int(dcfg[name], f'distill.{name}', 1)
  for name, limit in dcfg.prompt_sets.items():
    if limit is not None:
      check_int(limit, f'distill.prompt_sets.{name}')


# The numbers of a stored model config (a dspec checkpoint's metadata `config`, a model's
# config.json) with a range, by field name in either form; every other number in one must
# be finite. A corrupt or hand-edited value is refused, not run: NaN confidence
# temperatures switch DSpark's verify rule off, a negative eps makes every norm NaN.
_POSITIVE = functools.partial(check_float, low=0.0, low_open=True)
_EPS = functools.partial(check_float, low=0.0, high=1.0, low_open=True, high_open=True)
STORED_CONFIG_RANGES = {
    'rope_theta': _POSITIVE,
    'norm_eps': _EPS, 'rms_norm_eps': _EPS,
    'input_embedding_scale': _POSITIVE, 'output_multiplier': _POSITIVE,
    'confidence_temperatures': _POSITIVE, 'greedy_confidence_temperatures': _POSITIVE,
    'dspec_confidence_temperatures': _POSITIVE,
    'dspec_greedy_confidence_temperatures': _POSITIVE,
    'block_size': functools.partial(check_int, low=2),
    'mask_token_id': check_int,
}


def check_stored_config(config, prefix: str = '') -> None:
  """UserError naming the field (dotted path, list index) of the first number in `config`
  (a JSON value read from a model's files) that is not finite or is out of its range
  (`STORED_CONFIG_RANGES`); the caller names the file."""

  def walk(node, path, check):
    if isinstance(node, dict):
      for key, value in node.items():
        walk(value, f'{path}.{key}' if path else str(key), STORED_CONFIG_RANGES.get(key))
    elif isinstance(node, (list, tuple)):
      for i, value in enumerate(node):
        walk(value, f'{path}[{i}]', check)
    elif isinstance(node, bool) or not isinstance(node, (int, float)):
      return
    elif check is not None:
      check(node, prefix + path)
    elif isinstance(node, float):
      check_float(node, prefix + path)

  walk(config, '', None)


# Config fields that were renamed (draft lengths before `num_draft` became the one knob) or
# removed: config path -> the new field (None: removed).
LEGACY_FIELDS = {
    'drafters.ngram.draft_len': 'drafters.ngram.num_draft',
    'drafters.suffix.max_draft': 'drafters.suffix.num_draft',
    'drafters.oracle.draft_len': 'drafters.oracle.num_draft',
    'drafters.self.draft_len': 'drafters.self.num_draft',
    'drafters.mtp.num_depths': 'drafters.mtp.num_draft',
    'drafters.dflash.block_size': 'drafters.dflash.num_draft (= block size - 1)',
    'drafters.oracle.source': None,
    'verify': None,
}


def legacy_field_message(path: str):
  """One line for a config path that no longer exists, or None."""
  if path not in LEGACY_FIELDS:
    return None
  new = LEGACY_FIELDS[path]
  if new is None:
    return f'config field {path} was removed (it had no effect)'
  return f'config field {path} was renamed: use {new}'


def _fields(node) -> list:
  return sorted(node.keys()) if hasattr(node, 'keys') else []


def unknown_field_message(cfg, path: str) -> Optional[str]:
  """One line for a dotted config path that `cfg` does not have (naming its near matches
  and the fields of the section it is missing from), or None when the path exists."""
  node, walked = cfg, []
  for part in path.split('.'):
    if not hasattr(node, 'keys'):
      return (f'config field {".".join(walked)} is a value, not a section: '
              f'{path} does not exist')
    if part in node:
      node, walked = node[part], walked + [part]
      continue
    fields = _fields(node)
    where = '.'.join(walked) or 'the config'
    near = difflib.get_close_matches(part, fields, n=3, cutoff=0.6)
    hint = f'did you mean {" or ".join(".".join(walked + [n]) for n in near)}? ' if near else ''
    shown = ', '.join(fields[:20]) + (', ...' if len(fields) > 20 else '')
    return f'unknown config field {path}: {hint}{where} has: {shown}'
  return None


def require_sections(cfg, sections: Sequence[str], script: str, config_file: str) -> None:
  """UserError unless `cfg` has every top-level field `script` reads (a config meant for
  another script, e.g. a decode config given to train.py, fails here in one line)."""
  missing = [name for name in sections if name not in cfg]
  if missing:
    raise UserError(f'{config_file} is not a {script} config: it has no '
                    f'{", ".join(repr(m) for m in missing)} field')
