"""The decode job behind `scripts/decode.py`: build, validate, run, time, compare with AR."""

from __future__ import annotations

import os
import statistics
import time
from typing import Optional, Sequence

import jax
import numpy as np
from flax import nnx

from dspec import sharding
from dspec.cli import UserError
from dspec.decoding.drafters import registry
from dspec.decoding.engine import SpeculativeEngine
from dspec.decoding.host_loop import generate_host_loop
from dspec.decoding.sampling import SamplingSpec
from dspec.decoding.sharded import ShardedEngine
from dspec.metrics import acceptance_metrics
from dspec.models.config import TransformerConfig
from dspec.models.transformer import Transformer
from dspec.tokenizer import load_tokenizer


def build_target(model_cfg, placement: Optional[sharding.Placement] = None):
  """(Transformer, tokenizer, max_seq_len) from the config's `model` section.

  With a `placement`, params live on its mesh (random init: created already sharded).
  """
  source = model_cfg.source
  if source == 'random':
    cfg = TransformerConfig(**model_cfg.shape)
    ctor = lambda: Transformer(cfg, rngs=nnx.Rngs(model_cfg.seed))
    target = placement.for_model(cfg).create_module(ctor) if placement else ctor()
    weights_dir = None
  elif source == 'checkpoint':
    from dspec import checkpoint
    target, _ = checkpoint.load_target(model_cfg.path)
    weights_dir = model_cfg.path
  elif source == 'hf':
    from dspec import hf_import
    target, _ = hf_import.load_hf_model(model_cfg.path)
    weights_dir = model_cfg.path
  else:
    raise UserError(f'unknown model.source {source!r}; use random, checkpoint or hf')
  tok_dir = model_cfg.tokenizer_dir or weights_dir
  if tok_dir and not os.path.exists(os.path.join(tok_dir, 'tokenizer.json')):
    tok_dir = None if not model_cfg.tokenizer_dir else tok_dir
  tokenizer = load_tokenizer(tok_dir, target.cfg.vocab_size)
  if placement and source != 'random':
    sharding.place_module(target, placement.for_model(target.cfg))
  return target, tokenizer, model_cfg.max_seq_len


def validate_sampling(cfg) -> SamplingSpec:
  spec = SamplingSpec.create(cfg.temperature, cfg.top_k, cfg.top_p)
  if cfg.max_new_tokens < 1:
    raise UserError(f'max_new_tokens must be >= 1, got {cfg.max_new_tokens}')
  if cfg.batch_size < 1:
    raise UserError(f'batch_size must be >= 1, got {cfg.batch_size}')
  if cfg.verify not in ('auto', 'greedy', 'rejection'):
    raise UserError(f'verify must be auto, greedy or rejection, got {cfg.verify!r}')
  if cfg.verify == 'greedy' and not spec.greedy:
    raise UserError('verify=greedy needs temperature=0 (sampling needs rejection)')
  if cfg.verify == 'rejection' and spec.greedy:
    raise UserError('verify=rejection needs temperature > 0')
  return spec


def encode_prompts(prompts: Sequence, tokenizer, vocab_size: int, batch_size: int,
                   max_total: int, max_new_tokens: int):
  """Token-id prompts (texts are encoded) padded to `[batch, P]`, plus their lengths."""
  ids = []
  for p in prompts:
    row = tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p]
    if not row:
      raise UserError('empty prompt: give --prompt text or --prompt_ids')
    bad = [t for t in row if not 0 <= t < vocab_size]
    if bad:
      raise UserError(f'prompt token ids {bad[:5]} out of range for vocab size {vocab_size}')
    if len(row) + max_new_tokens > max_total:
      raise UserError(f'prompt of {len(row)} tokens + max_new_tokens={max_new_tokens} '
                      f'exceeds the model context of {max_total} tokens')
    ids.append(row)
  if not ids:
    raise UserError('no prompt given')
  ids = [ids[i % len(ids)] for i in range(batch_size)]
  width = max(len(r) for r in ids)
  prompt_BP = np.zeros((batch_size, width), np.int32)
  for i, r in enumerate(ids):
    prompt_BP[i, :len(r)] = r
  return prompt_BP, np.array([len(r) for r in ids], np.int32)


def generated_ids(state) -> list:
  """Generated token ids of each row (prompt excluded)."""
  tokens = np.asarray(state.tokens_BL)
  lens, nums = np.asarray(state.prompt_len_B), np.asarray(state.num_tokens_B)
  return [tokens[b, lens[b]:nums[b]].tolist() for b in range(tokens.shape[0])]


def run_generation(engine, target_params, drafter_params, prompt_BP, prompt_len_B, cfg,
                   host_drafter=None):
  """prefill + decode once; returns (final state, prefill seconds, decode seconds)."""
  t0 = time.perf_counter()
  state = engine.prefill(target_params, drafter_params, prompt_BP, prompt_len_B,
                         temperature=cfg.temperature, top_p=cfg.top_p,
                         max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
  jax.block_until_ready(state)
  t1 = time.perf_counter()
  if host_drafter is None:
    state = engine.generate(target_params, drafter_params, state)
  else:
    state = generate_host_loop(engine, target_params, drafter_params, state, host_drafter)
  jax.block_until_ready(state)
  return state, t1 - t0, time.perf_counter() - t1


def timed_generation(engine, target_params, drafter_params, prompt_BP, prompt_len_B, cfg,
                     host_drafter_factory=None) -> dict:
  """Warm-up (compile) run, then `timing_repeats` runs; medians reported."""
  make = host_drafter_factory or (lambda: None)
  t = time.perf_counter()
  state, _, _ = run_generation(engine, target_params, drafter_params, prompt_BP,
                               prompt_len_B, cfg, make())
  warmup_s = time.perf_counter() - t
  prefill, decode = [], []
  for _ in range(max(1, cfg.timing_repeats)):
    state, p, d = run_generation(engine, target_params, drafter_params, prompt_BP,
                                 prompt_len_B, cfg, make())
    prefill.append(p)
    decode.append(d)
  decode_s = statistics.median(decode)
  prefill_s = statistics.median(prefill)
  new_tokens = int(np.sum(np.asarray(state.num_tokens_B) - np.asarray(state.prompt_len_B)))
  return {'state': state, 'decode_s': decode_s, 'prefill_s': prefill_s,
          'compile_s': max(0.0, warmup_s - decode_s - prefill_s),
          'new_tokens': new_tokens, 'tokens_per_s': new_tokens / decode_s}


def configured_prompt(cfg) -> str:
  """The config's prompt: `prompt_set[prompt_index]` when a prompt set is named, else
  `prompt`."""
  if not cfg.prompt_set:
    return cfg.prompt
  from dspec.training.corpus import load_prompts
  return load_prompts(cfg.prompt_set, cfg.data_dir)[cfg.prompt_index]


def run_decode(cfg, prompts: Optional[Sequence] = None) -> dict:
  """Runs the configured drafter (and AR when compared or needed); returns the report.

  With `cfg.mesh` set, params and decode state are sharded over that mesh and the same
  programs run with in/out shardings (`ShardedEngine`); tokens equal the 1-device run.
  """
  spec = validate_sampling(cfg)
  placement = sharding.placement_from_config(cfg)
  target, tokenizer, max_seq_len = build_target(cfg.model, placement)
  placement = placement and placement.for_model(target.cfg)
  on_mesh = (lambda e: ShardedEngine(e, placement)) if placement else (lambda e: e)
  prompts = prompts or [configured_prompt(cfg)]
  prompt_BP, prompt_len_B = encode_prompts(prompts, tokenizer, target.cfg.vocab_size,
                                           cfg.batch_size, max_seq_len, cfg.max_new_tokens)
  graphdef, target_params = nnx.split(target)
  stop_ids = tuple(tokenizer.stop_ids)
  ar_engine = on_mesh(SpeculativeEngine(graphdef, sampling=spec, stop_ids=stop_ids))

  ar = None
  if cfg.compare_ar or cfg.drafter == 'oracle':
    ar = timed_generation(ar_engine, target_params, None, prompt_BP, prompt_len_B, cfg)
  drafter, drafter_params = registry.build_drafter(
      cfg, target, None if ar is None else ar['state'].tokens_BL)
  host_factory = getattr(drafter, 'host_drafter_factory', None)
  if placement:
    drafter_params = placement.put_params(drafter_params)
  engine = on_mesh(SpeculativeEngine(graphdef, drafter=drafter, sampling=spec,
                                     stop_ids=stop_ids))
  spec_run = timed_generation(engine, target_params, drafter_params, prompt_BP,
                              prompt_len_B, cfg, host_factory)

  outputs = generated_ids(spec_run['state'])
  report = {
      'method': cfg.drafter if cfg.drafter != 'none' else 'ar',
      'temperature': float(cfg.temperature),
      'batch_size': int(cfg.batch_size),
      'draft_len': int(drafter.num_draft),
      'new_tokens': spec_run['new_tokens'],
      'tokens_per_s': spec_run['tokens_per_s'],
      'decode_s': spec_run['decode_s'],
      'prefill_s': spec_run['prefill_s'],
      'compile_s': spec_run['compile_s'],
      'output_ids': outputs[0],
      'text': tokenizer.decode(outputs[0]),
  }
  report.update(acceptance_metrics(spec_run['state'].stats))
  if ar is not None:
    ar_outputs = generated_ids(ar['state'])
    report['ar_tokens_per_s'] = ar['tokens_per_s']
    report['ar_decode_s'] = ar['decode_s']
    report['speedup'] = ar['decode_s'] / spec_run['decode_s']
    report['lossless'] = (ar_outputs == outputs) if spec.greedy else None
  else:
    report.update(ar_tokens_per_s=None, speedup=None, lossless=None)
  return report
