"""Continuous batching: a request queue refills the rows of finished sequences.

A static batch (`engine.generate`) keeps every row in the compiled shape until the last
one finishes: done rows stop writing (no tokens, no cache growth, no drafter update) but
still ride along in every verify forward, so a batch whose lengths differ wastes work.
`serve` keeps the shape and the compiled programs, and instead puts a new request into a
row as soon as it finishes:

  1. prefill the first `batch_size` requests (prompts padded to one width, so one
     buffer length and one compiled step serve every request);
  2. run engine steps on device until some row finishes (or `steps_per_sync` steps);
  3. read back the finished rows, then prefill each waiting request alone (batch 1) and
     write its state into the freed row: every leaf of the decode state whose declared
     logical axes have a batch axis (tokens, lengths, KV caches, drafter caches, stats)
     takes the new row; scalars (step, key, sampling values) are shared.

Outputs are per request and lossless as with `generate` (each row is its own sequence;
at T > 0 a refilled row draws from the batch's key stream, still an exact sample).
"""

from __future__ import annotations

import time
from typing import List, Sequence

import jax
import jax.numpy as jnp

from dspec.decoding.engine import SpeculativeEngine
from dspec.decoding.prompts import generated_ids, pad_prompts
from dspec.sharding import state_logical_axes


def _insert_row(state, row_state, row):
  """`state` with batch row `row` replaced by the (batch-1) `row_state`: every leaf with
  a declared batch axis takes the new row; the others (step, key, ...) are shared."""
  def put(path, x, y):
    axes = state_logical_axes(state, path, x.ndim)
    axis = axes.index('batch') if 'batch' in axes else None
    if axis is None:
      return x
    return jax.lax.dynamic_update_slice_in_dim(x, y.astype(x.dtype), row, axis)
  return jax.tree_util.tree_map_with_path(put, state, row_state)


_jit_insert = jax.jit(_insert_row, donate_argnums=0)


def serve(engine, target_params, drafter_params,
          requests: Sequence[Sequence[int]], batch_size: int, *, max_new_tokens: int,
          temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
          steps_per_sync: int = 64) -> dict:
  """Decodes every request (token-id prompts) with `batch_size` rows, refilling rows.
  `engine`: a fixed-verification engine (steps run until a row finishes or
  `steps_per_sync`), or the controller of `verify_length='auto'` (rows refilled between
  its chunks, each chunk's verify length its policy's).

  Returns {'outputs': generated ids per request (request order), 'accepted',
  'proposed', 'steps' (per request), 'decode_s', 'row_steps', 'live_row_steps'}:
  row_steps counts rows × steps run, live_row_steps only rows that were decoding.
  """
  if not requests or batch_size < 1:
    raise ValueError('serve needs at least one request and batch_size >= 1')
  if getattr(engine, 'host', None) is not None:
    raise ValueError('serve refills rows on the device; a drafter proposing on the host '
                     '(suffix) decodes through dspec.generate / scripts/decode.py')
  width = max(len(r) for r in requests)
  padded = lambda rows: pad_prompts(rows, width_multiple=width)

  kw = dict(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed)
  first = list(range(min(batch_size, len(requests))))
  rows = [requests[i] for i in first] + [requests[0]] * (batch_size - len(first))
  state = engine.prefill(target_params, drafter_params, *padded(rows), **kw)
  # Padding rows (fewer requests than rows) start out done.
  state = state.replace(done_B=state.done_B | (jnp.arange(batch_size) >= len(first)))
  slot = first + [None] * (batch_size - len(first))
  queue = list(range(len(first), len(requests)))
  n = len(requests)
  result = {'outputs': [None] * n, 'accepted': [0] * n, 'proposed': [0] * n,
            'steps': [0] * n}
  counts = {'row_steps': 0, 'live_row_steps': 0, 'step': int(state.step)}

  def refill(state):
    """Reads the finished rows back and puts waiting requests into them; returns (state,
    whether a row was refilled)."""
    done, tokens, nums, lens, steps, acc, prop, step = jax.device_get((
        state.done_B, state.tokens_BL, state.num_tokens_B, state.prompt_len_B,
        state.stats.steps_B, state.stats.accepted_B, state.stats.proposed_B, state.step))
    counts['row_steps'] += batch_size * (int(step) - counts['step'])
    counts['step'] = int(step)
    refilled = False
    for r in range(batch_size):
      if slot[r] is None or not done[r]:
        continue
      i, slot[r] = slot[r], None
      result['outputs'][i] = tokens[r, lens[r]:nums[r]].tolist()
      result['steps'][i], result['accepted'][i] = int(steps[r]), int(acc[r])
      result['proposed'][i] = int(prop[r])
      counts['live_row_steps'] += int(steps[r])
      if queue:
        j = queue.pop(0)
        row_state = engine.prefill(target_params, drafter_params, *padded([requests[j]]),
                                   **kw)
        state = _jit_insert(state, row_state, r)
        slot[r], refilled = j, True
    return state, refilled

  t0 = time.perf_counter()
  if engine.adaptive:   # the controller: refills between its chunks
    engine.generate(target_params, drafter_params, state, between_chunks=refill)
  else:
    while any(s is not None for s in slot):
      state = engine.run(target_params, drafter_params, state, steps_per_sync,
                         until_row_done=True)
      state, _ = refill(state)
  result.update(decode_s=time.perf_counter() - t0, row_steps=counts['row_steps'],
                live_row_steps=counts['live_row_steps'])
  return result


def static_batches(engine: SpeculativeEngine, target_params, drafter_params,
                   requests: Sequence[Sequence[int]], batch_size: int,
                   **kw) -> List[List[int]]:
  """The reference: consecutive static batches through `engine.generate` (ids per
  request), e.g. to compare with `serve`."""
  outs = []
  width = max(len(r) for r in requests)
  for s in range(0, len(requests), batch_size):
    prompt_BP, lens = pad_prompts(requests[s:s + batch_size], width_multiple=width)
    state = engine.generate(target_params, drafter_params,
                            engine.prefill(target_params, drafter_params, prompt_BP, lens,
                                           **kw))
    outs += generated_ids(state)
  return outs
