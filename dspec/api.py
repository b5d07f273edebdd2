"""The Python API: load a target, load a drafter, generate.

  import dspec
  target = dspec.load_target('demo/target')              # or a Hugging Face model dir
  drafter = dspec.load_drafter('dflash', 'demo/dflash', target=target)
  out = dspec.generate(target, ['def add(a, b):'], drafter=drafter, max_new_tokens=32)
  out.texts, out.ids, out.metrics['tau'], out.per_prompt

Greedy output (temperature 0) equals what the target alone generates, token for token;
sampled output has the target's distribution. Bad arguments raise ValueError naming them.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional, Sequence

import ml_collections

from dspec import loading
from dspec.decoding import runner
from dspec.decoding.drafters import registry

Target = runner.Target


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


def load_target(path: str, *, tokenizer_dir: str = '', max_seq_len: int = 4096) -> Target:
  """A dspec target checkpoint or a Hugging Face Llama/Qwen3 directory (detected), with its
  tokenizer (from `tokenizer_dir`, else the model directory, else bytes)."""
  model_cfg = ml_collections.ConfigDict({
      'source': loading.target_source(path), 'path': path, 'tokenizer_dir': tokenizer_dir,
      'seed': 0, 'max_seq_len': max_seq_len, 'shape': {}})
  model, tokenizer, max_seq_len = loading.build_target(model_cfg)
  return Target(model, tokenizer, max_seq_len)


def load_drafter(kind: str, path: Optional[str] = None, *, target: Target,
                 **overrides) -> Drafter:
  """Builds drafter `kind` (see `registry.known()`) for `target`.

  `path`: the checkpoint of a learned drafter (mtp, dflash). `overrides` set fields of its
  config (`registry.DEFAULTS[kind]`), e.g. `num_draft=7`.
  """
  if kind not in registry.known():
    raise ValueError(f'unknown drafter {kind!r}; known: {", ".join(registry.known())}')
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
      fields[name] = value
  elif path is not None or overrides:
    raise ValueError("the 'none' drafter takes no path or fields")
  drafter, params = registry.build_drafter(cfg, target.model)
  return Drafter(kind, drafter, params)


def generate(target: Target, prompts: Sequence, drafter: Optional[Drafter] = None, *,
             max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, batch_size: int = 0,
             compare_ar: bool = False, timing_repeats: int = 0,
             verify_length: str = 'auto', trace: bool = False) -> Generation:
  """Continues every prompt (a list of strings or of token-id lists) with `drafter`
  (None: plain AR decoding), all prompts in one batch unless `batch_size` is larger.

  compare_ar: also run AR on the same prompts, for `speedup` and `lossless`.
  timing_repeats: > 0 times that many runs after a warm-up (medians); 0 runs once.
  verify_length: 'auto' (the load-aware controller picks each chunk's verify length, AR
  included, so a drafter that does not pay falls back to AR) or 'fixed' (always
  `num_draft`).
  """
  if isinstance(prompts, (str, bytes)):
    raise ValueError('prompts must be a list of strings or token-id lists '
                     '(wrap a single prompt in a list)')
  if drafter is not None and not isinstance(drafter, Drafter):
    raise ValueError('drafter must come from dspec.load_drafter')
  settings = runner.Settings(max_new_tokens=int(max_new_tokens),
                             temperature=float(temperature), top_k=int(top_k),
                             top_p=float(top_p), seed=int(seed),
                             timing_repeats=int(timing_repeats))
  out = runner.decode(target, list(prompts), drafter and drafter.drafter,
                      drafter and drafter.params, settings=settings,
                      batch_size=int(batch_size), compare_ar=compare_ar,
                      verify_length=verify_length, trace=trace)
  return Generation(**out)
