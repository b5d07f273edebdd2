"""The `transformers` peer: HF `generate` on CPU with the same weights, prompts and lengths.

The dspec target is exported with `hf_export.to_transformers_model` (torch fp32, eval). Three
methods, greedy, batch 1 (HF assisted generation takes no batches):
  hf_ar             plain `generate`
  hf_prompt_lookup  `prompt_lookup_num_tokens=K` (+ `max_matching_ngram_size`)
  hf_assisted       `assistant_model=` the target truncated to its first N decoder layers
                    (same embeddings, final norm and head, so it shares the tokenizer and
                    drafts like an early exit); draft length knobs from `bench.hf`, by
                    default HF's (20 tokens, constant schedule, confidence threshold 0.4)
Timing per prompt: one warm-up call per method, then the median of `repeats` calls; decode
time = generate time − the target's prompt forward (median of >= 5), like dspec's
prefill-excluded decode time (HF's prompt forward also yields the first token, so HF is
charged one step less). Generation stops at the tokenizer's stop ids, as in dspec.
Torch threads: `hf.torch_threads`, or with 0 the fastest of 1..cpu_count for a one-token
forward (on a busy CPU, torch's default of one thread per core can be several times slower).
"""

from __future__ import annotations

import copy
import functools
import os
import statistics
import time

import numpy as np

HF_METHODS = ('hf_ar', 'hf_prompt_lookup', 'hf_assisted')


def truncated_assistant(hf_model, num_layers: int):
  """A copy of `hf_model` keeping its first `num_layers` decoder layers."""
  total = len(hf_model.model.layers)
  if not 1 <= num_layers < total:
    raise ValueError(f'bench.hf.assistant_layers must be in [1, {total - 1}], got {num_layers}')
  assistant = copy.deepcopy(hf_model)
  assistant.model.layers = assistant.model.layers[:num_layers]
  assistant.config.num_hidden_layers = num_layers
  if getattr(assistant.config, 'layer_types', None):
    assistant.config.layer_types = assistant.config.layer_types[:num_layers]
  return assistant.eval()


def _median_s(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def pick_torch_threads(hf_model) -> int:
  """The thread count (1..cpu_count) with the fastest one-token forward (weight-read bound)."""
  import torch
  token = torch.zeros((1, 1), dtype=torch.long)

  def forward():
    hf_model(token)

  times = {}
  for threads in range(1, (os.cpu_count() or 1) + 1):
    torch.set_num_threads(threads)
    forward()
    times[threads] = _median_s(forward, 7)
  best = min(times, key=times.get)
  torch.set_num_threads(best)
  return best


def time_hf_generate(target, prompts: list, max_new_tokens: int, stop_ids: tuple,
                     hf_cfg, repeats: int, progress=None) -> tuple:
  """({method: {'decode_s', 'new_tokens', 'outputs'} lists per prompt}, torch threads)."""
  import torch

  from dspec.hf_export import to_transformers_model

  hf_model = to_transformers_model(target)
  assistant = truncated_assistant(hf_model, hf_cfg.assistant_layers)
  shared = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                eos_token_id=list(stop_ids) or None)
  kwargs = {
      'hf_ar': {},
      'hf_prompt_lookup': dict(prompt_lookup_num_tokens=hf_cfg.prompt_lookup_num_tokens,
                               max_matching_ngram_size=hf_cfg.max_matching_ngram_size),
      'hf_assisted': dict(assistant_model=assistant,
                          num_assistant_tokens=hf_cfg.num_assistant_tokens,
                          num_assistant_tokens_schedule=hf_cfg.num_assistant_tokens_schedule,
                          assistant_confidence_threshold=hf_cfg.assistant_confidence_threshold),
  }
  results = {m: {'decode_s': [], 'new_tokens': [], 'outputs': []} for m in HF_METHODS}
  with torch.inference_mode():
    if hf_cfg.torch_threads > 0:
      torch.set_num_threads(hf_cfg.torch_threads)
    else:
      pick_torch_threads(hf_model)
    for prompt in prompts:
      ids = torch.tensor([prompt], dtype=torch.long)
      hf_model(ids)
      prefill_s = _median_s(lambda: hf_model(ids), max(5, repeats))
      for method in HF_METHODS:
        generate = functools.partial(hf_model.generate, ids, **shared, **kwargs[method])
        out = generate()[0, len(prompt):].tolist()
        total_s = _median_s(generate, repeats)
        results[method]['decode_s'].append(max(total_s - prefill_s, 1e-9))
        results[method]['new_tokens'].append(len(out))
        results[method]['outputs'].append(out)
        if progress is not None:
          progress(method)
  return results, torch.get_num_threads()


def tokens_per_s(decode_s: list, new_tokens: list) -> float:
  return float(np.sum(new_tokens) / max(np.sum(decode_s), 1e-9))
