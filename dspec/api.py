"""The Python API: load a target, load a drafter, generate.

  import dspec
  target = dspec.load_target('demo/target')              # or a Hugging Face model dir
  drafter = dspec.load_drafter('dflash', 'demo/dflash', target=target)
  out = dspec.generate(target, ['def add(a, b):'], drafter=drafter, max_new_tokens=32)
  out.texts, out.ids, out.metrics['tau'], out.per_prompt

Calls compile per shape bucket (prompt width and token buffer padded to powers of two,
`prompts.bucket_shapes`), not per prompt length; `warmup` compiles (and profiles) the
buckets of given prompt lengths ahead, so that later calls in them compile nothing.
Greedy output (temperature 0) equals what the target alone generates, token for token;
sampled output has the target's distribution. Every argument is checked before anything
loads or compiles: a wrong type or value raises ValueError naming the argument and the
value, and nothing is coerced (a float `max_new_tokens`, float token ids, bytes or a dict of
prompts are refused, not converted).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import sys
import time
from typing import Any, Optional, Sequence

import ml_collections
import numpy as np

from dspec import loading
from dspec.decoding import runner
from dspec.decoding.drafters import registry
from dspec.decoding.prompts import bucket_shapes
from dspec.errors import CheckpointError, DspecError

Target = runner.Target
INT32_MAX = 2 ** 31 - 1
WARMUP_TEXT = 'def add(a, b):\n  """The sum of a and b."""\n  return a + b\n\n'


def _is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value) -> bool:
  return _is_int(value) or isinstance(value, (float, np.floating))


def _int(name: str, value, low: int, high: int = INT32_MAX) -> int:
  if not _is_int(value):
    raise ValueError(f'{name} must be an integer, got {value!r} ({type(value).__name__})')
  if not low <= value <= high:
    raise ValueError(f'{name} must be in [{low}, {high}], got {value}')
  return int(value)


def _float(name: str, value, low: float, high: float = math.inf, *,
           low_open: bool = False) -> float:
  if not _is_number(value):
    raise ValueError(f'{name} must be a number, got {value!r} ({type(value).__name__})')
  value = float(value)
  if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
    lo = '(' if low_open else '['
    raise ValueError(f'{name} must be a finite number in {lo}{low:g}, {high:g}], got {value}')
  return value


def _bool(name: str, value) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f'{name} must be True or False, got {value!r}')
  return bool(value)


def _path(name: str, value, optional: bool = False) -> str:
  if optional and value in (None, ''):
    return ''
  if not isinstance(value, (str, os.PathLike)) or isinstance(value, bytes):
    raise ValueError(f'{name} must be a path (str or os.PathLike), got {value!r} '
                     f'({type(value).__name__})')
  path = os.fspath(value)
  if not isinstance(path, str) or not path:
    raise ValueError(f'{name} must be a non-empty path, got {value!r}')
  return path


def _prompt_rows(prompts) -> list:
  """`prompts` checked: a non-empty list or tuple of strings or of token-id sequences."""
  if not isinstance(prompts, (list, tuple)):
    hint = (' (wrap a single prompt in a list)' if isinstance(prompts, (str, bytes)) else '')
    raise ValueError(f'prompts must be a list of strings or token-id lists{hint}, got '
                     f'{type(prompts).__name__} {prompts!r:.60}')
  if not prompts:
    raise ValueError('prompts must be a non-empty list of strings or token-id lists')
  rows = []
  for i, prompt in enumerate(prompts):
    if isinstance(prompt, str):
      rows.append(prompt)
      continue
    if isinstance(prompt, np.ndarray) and prompt.ndim == 1:
      prompt = prompt.tolist() if np.issubdtype(prompt.dtype, np.integer) else list(prompt)
    if not isinstance(prompt, (list, tuple)):
      raise ValueError(f'prompts[{i}] must be a string or a list of token ids, got '
                       f'{type(prompt).__name__} {prompt!r:.60}')
    bad = [t for t in prompt if not _is_int(t)]
    if bad:
      raise ValueError(f'prompts[{i}] must hold integer token ids, got {bad[0]!r} '
                       f'({type(bad[0]).__name__})')
    rows.append([int(t) for t in prompt])
  return rows


def _field_value(kind: str, name: str, default, value):
  """A drafter field override checked against the type of its default."""
  where = f'{kind} drafter field {name}'
  if isinstance(default, bool):
    return _bool(where, value)
  if isinstance(default, int):
    return _int(where, value, -INT32_MAX)
  if isinstance(default, float):
    return _float(where, value, -math.inf)
  if isinstance(default, str):
    if name == 'path':
      return _path(where, value)
    if not isinstance(value, str):
      raise ValueError(f'{where} must be a string, got {value!r}')
    return value
  if isinstance(default, (list, tuple)):
    if not isinstance(value, (list, tuple)) or not all(_is_number(v) for v in value):
      raise ValueError(f'{where} must be a list of numbers, got {value!r}')
    return list(value)
  return value


@dataclasses.dataclass(frozen=True)
class Drafter:
  """A built drafter (`dspec.decoding.drafter` protocol) with its params."""

  kind: str
  drafter: Any
  params: Any = None

  @property
  def num_draft(self) -> int:
    return self.drafter.num_draft


@dataclasses.dataclass
class Generation:
  """What `generate` returns: per prompt texts and token ids (the continuation only),
  overall `metrics` (token-weighted τ, acceptance, tokens/s, ...; with `compare_ar` also
  `speedup` and `lossless`), `per_prompt` metrics and, with `trace=True`, row 0's trace."""

  texts: list
  ids: list
  metrics: dict
  per_prompt: list
  trace: Optional[dict] = None


def _constraints(num_rows: int, **given) -> Optional[list]:
  """One `Constraint` (or None) per prompt from generate's json_schema / regex / grammar,
  each one value for every prompt or a list of one (or None) per prompt."""
  from dspec.structured import Constraint
  per_kind = {}
  for kind, value in given.items():
    if value is None:
      continue
    if isinstance(value, (list, tuple)):
      if len(value) != num_rows:
        raise ValueError(f'{kind}: a list needs one entry (or None) per prompt '
                         f'({num_rows}), got {len(value)}')
      per_kind[kind] = list(value)
    else:
      per_kind[kind] = [value] * num_rows
  if not per_kind:
    return None
  return [Constraint.of(**{k: v[i] for k, v in per_kind.items()}) for i in range(num_rows)]


def load_target(path: str, *, tokenizer_dir: str = '', max_seq_len: int = 4096,
                widen_mlp: int = 1) -> Target:
  """A dspec target checkpoint or a Hugging Face Llama/Qwen3 directory (detected), with its
  tokenizer (from `tokenizer_dir`, else the model directory, else bytes). `widen_mlp` > 1:
  its MLPs that many times wider, writing the same tokens (`dspec.models.widen`).
  Raises ValueError for a bad argument, CheckpointError (a ValueError, `dspec.errors`) for
  a path that holds no readable target (another kind, corrupt, two models' files)."""
  path = _path('path', path)
  tokenizer_dir = _path('tokenizer_dir', tokenizer_dir, optional=True)
  max_seq_len = _int('max_seq_len', max_seq_len, 2)
  widen_mlp = _int('widen_mlp', widen_mlp, 1)
  try:
    model_cfg = ml_collections.ConfigDict({
        'source': loading.target_source(path), 'path': path, 'tokenizer_dir': tokenizer_dir,
        'seed': 0, 'max_seq_len': max_seq_len, 'shape': {}, 'widen_mlp': widen_mlp})
    model, tokenizer, max_seq_len = loading.build_target(model_cfg)
  except ValueError as e:   # the arguments are checked: the path holds no readable target
    if isinstance(e, DspecError):
      raise
    raise CheckpointError(str(e)) from e
  return Target(model, tokenizer, max_seq_len)


def load_drafter(kind: str, path: Optional[str] = None, *, target: Target,
                 **overrides) -> Drafter:
  """Builds drafter `kind` (see `registry.known()`) for `target`.

  `path`: the checkpoint of a learned drafter (mtp, dflash). `overrides` set fields of its
  config (`registry.DEFAULTS[kind]`), e.g. `num_draft=7`. Raises ValueError for a bad
  argument, CheckpointError (a ValueError, `dspec.errors`) for a path that holds no
  readable drafter of `kind`.
  """
  if not isinstance(kind, str) or kind not in registry.known():
    raise ValueError(f'unknown drafter {kind!r}; known: {", ".join(registry.known())}')
  if not isinstance(target, Target):
    raise ValueError(f'target must come from dspec.load_target, got {type(target).__name__}')
  cfg = ml_collections.ConfigDict({'drafter': kind,
                                   'drafters': copy.deepcopy(registry.DEFAULTS)})
  if kind != 'none':
    fields = cfg.drafters[kind]
    if path is not None:
      overrides = dict(overrides, path=path)
    for name, value in overrides.items():
      if name not in fields:
        raise ValueError(f'{kind} drafter has no field {name!r}; fields: '
                         f'{", ".join(sorted(fields))}')
      fields[name] = _field_value(kind, name, fields[name], value)
  elif path is not None or overrides:
    raise ValueError("the 'none' drafter takes no path or fields")
  drafter, params = registry.build_drafter(cfg, target.model)
  return Drafter(kind, drafter, params)


def generate(target: Target, prompts: Sequence, drafter: Optional[Drafter] = None, *,
             max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, batch_size: int = 0,
             compare_ar: bool = False, timing_repeats: int = 0,
             verify_length: str = 'auto', trace: bool = False,
             json_schema=None, regex=None, grammar=None,
             forced_drafts: bool = True) -> Generation:
  """Continues every prompt (a list of strings or of token-id lists) with `drafter`
  (None: plain AR decoding), all prompts in one batch unless `batch_size` is larger.

  compare_ar: also run AR on the same prompts, for `speedup` and `lossless`.
  timing_repeats: > 0 times that many runs after a warm-up (medians); 0 runs once.
  verify_length: 'auto' (the load-aware controller picks each chunk's verify length, AR
  included, so a drafter that does not pay falls back to AR), 'fixed' (always
  `num_draft`) or 'tree' (a token tree of up to 32 nodes per step in one target pass,
  `dspec.decoding.tree_proposers`: top-8 trees over one block pass for DFlash (per slot)
  and DFlash-2 (by its selector); EAGLE-2 dynamic trees for EAGLE-3, MTP and DSpark's
  Markov walk, sampled chains for those at T > 0; the most recent matches for n-gram; the
  host-side suffix drafter has no tree mode), or 'auto_tree' (the controller picks each
  chunk's node budget from measured costs: trees of 2, 4, 8, 16 and 32 nodes, or AR).
  json_schema (a dict or its JSON text), regex (the whole output matches it), grammar
  (Lark text): structured output, one for every prompt or a list with one (or None) per
  prompt; the output equals constrained AR's (T = 0) or follows its distribution. Chains
  only ('auto' then verifies every proposal whole). forced_drafts: draft the tokens the
  constraint forces (e.g. JSON keys). `metrics['constraint_complete']` says per prompt
  whether the output is a finished match (False: max_new_tokens ended inside it).
  Raises ValueError for a bad argument, before anything compiles.
  """
  if not isinstance(target, Target):
    raise ValueError(f'target must come from dspec.load_target, got {type(target).__name__}')
  rows = _prompt_rows(prompts)
  if drafter is not None and not isinstance(drafter, Drafter):
    raise ValueError(f'drafter must come from dspec.load_drafter (or be None), got '
                     f'{type(drafter).__name__}')
  if drafter is not None:   # one loaded for another target: refused naming both shapes
    drafter.drafter.check_target(target.model.cfg)
  runner.check_verify_length(verify_length)
  settings = runner.Settings(
      max_new_tokens=_int('max_new_tokens', max_new_tokens, 1, INT32_MAX // 2),
      temperature=_float('temperature', temperature, 0.0),
      top_k=_int('top_k', top_k, 0), top_p=_float('top_p', top_p, 0.0, 1.0, low_open=True),
      seed=_int('seed', seed, 0), timing_repeats=_int('timing_repeats', timing_repeats, 0))
  constraints = _constraints(len(rows), json_schema=json_schema, regex=regex,
                             grammar=grammar)
  out = runner.decode(target, rows, drafter and drafter.drafter,
                      drafter and drafter.params, settings=settings,
                      batch_size=_int('batch_size', batch_size, 0),
                      compare_ar=_bool('compare_ar', compare_ar),
                      verify_length=verify_length, trace=_bool('trace', trace),
                      constraints=constraints,
                      forced_drafts=_bool('forced_drafts', forced_drafts))
  return Generation(**out)


def warmup(target: Target, drafter: Optional[Drafter] = None, *,
           prompt_lengths: Sequence[int] = (64,), max_new_tokens: int = 64,
           batch_size: int = 1, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           verify_length: str = 'auto') -> list:
  """Compiles, and under verify_length 'auto' or 'auto_tree' profiles, the shape buckets
  that `generate` calls of `batch_size` prompts of `prompt_lengths` tokens with
  `max_new_tokens` and this sampling fall into (one generation of a filler prompt per
  bucket), so that later calls in those buckets compile nothing. Prints one line to
  stderr; returns the (prompt width, token buffer) buckets warmed."""
  if not isinstance(target, Target):
    raise ValueError(f'target must come from dspec.load_target, got {type(target).__name__}')
  if drafter is not None and not isinstance(drafter, Drafter):
    raise ValueError(f'drafter must come from dspec.load_drafter (or be None), got '
                     f'{type(drafter).__name__}')
  runner.check_verify_length(verify_length)
  max_new_tokens = _int('max_new_tokens', max_new_tokens, 1, INT32_MAX // 2)
  batch_size = _int('batch_size', batch_size, 1)
  if not isinstance(prompt_lengths, (list, tuple)) or not prompt_lengths:
    raise ValueError(f'prompt_lengths must be a non-empty list of integers, got '
                     f'{prompt_lengths!r:.60}')
  longest = target.max_seq_len - max_new_tokens - (drafter.num_draft if drafter else 0)
  lengths = [_int(f'prompt_lengths[{i}]', n, 1, max(longest, 1))
             for i, n in enumerate(prompt_lengths)]
  buckets = {bucket_shapes(n, max_new_tokens, target.max_seq_len): n for n in sorted(lengths)}
  filler = target.tokenizer.encode(WARMUP_TEXT)
  while len(filler) < max(lengths):
    filler += filler
  t0 = time.perf_counter()
  for n in buckets.values():
    generate(target, [filler[:n]], drafter, max_new_tokens=max_new_tokens,
             temperature=temperature, top_k=top_k, top_p=top_p, batch_size=batch_size,
             verify_length=verify_length)
  shapes = ', '.join(f'{p}/{b}' for p, b in buckets)
  print(f'dspec.warmup: {len(buckets)} shape buckets (prompt width/token buffer: {shapes}) '
        f'for batch size {batch_size}, verify_length={verify_length}, in '
        f'{time.perf_counter() - t0:.1f} s', file=sys.stderr, flush=True)
  return list(buckets)
