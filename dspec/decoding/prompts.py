"""Prompts in, token ids out: padding prompts into a batch and reading generations back."""

from __future__ import annotations

from typing import Sequence

import numpy as np


MIN_BUCKET = 64   # the smallest shape bucket (`shape_bucket`)


def shape_bucket(length: int, cap: int) -> int:
  """The least MIN_BUCKET * 2^k >= `length`, at most `cap` unless `length` exceeds it."""
  bucket = MIN_BUCKET
  while bucket < length:
    bucket *= 2
  return min(bucket, max(cap, length))


def bucket_shapes(longest: int, max_new_tokens: int, cap: int) -> tuple[int, int]:
  """(prompt width, token buffer length) for prompts of at most `longest` tokens: the
  buffer the `shape_bucket` of longest + max_new_tokens, the width one less than that of
  longest + 1 (the buffer keeps a slot past the prompt width, where drafters read the first
  generated token). `cap`: the model context.

  `runner.decode` (so `dspec.generate`) pads to these, so a process compiles per bucket,
  not per prompt length or max_new_tokens. With n buckets up to the context (7 for 4096
  tokens) it holds at most n (n + 1) / 2 prefill programs (width < buffer) and, per buffer
  bucket, one chunk program per verify tier plus the controller's few (plain AR, shadow
  proposal, judging), each for every batch size, sampling mode and drafter in use. The
  padding is masked as in a ragged batch (positions and outputs unchanged); its price is a
  prefill over up to twice the prompt and attention over up to twice the buffer.
  """
  return (shape_bucket(longest + 1, cap) - 1,
          shape_bucket(longest + max_new_tokens, cap))


def pad_prompts(rows: Sequence[Sequence[int]], batch_size: int = 0,
                width_multiple: int = 1, min_width: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """(prompt_BP int32, prompt_len_B int32): rows right-padded with 0 to one width (at
  least `min_width`, rounded up to `width_multiple`); with `batch_size` > len(rows) the
  rows repeat cyclically."""
  rows = [list(r) for r in rows]
  if not rows or min(len(r) for r in rows) < 1:
    raise ValueError('prompts must be a non-empty list of non-empty token lists')
  if batch_size:
    rows = [rows[i % len(rows)] for i in range(batch_size)]
  width = max(min_width, *(len(r) for r in rows))
  width = -(-width // width_multiple) * width_multiple
  prompt_BP = np.zeros((len(rows), width), np.int32)
  for i, r in enumerate(rows):
    prompt_BP[i, :len(r)] = r
  return prompt_BP, np.array([len(r) for r in rows], np.int32)


def encode_prompts(prompts: Sequence, tokenizer, vocab_size: int, max_total: int,
                   max_new_tokens: int, num_draft: int = 0,
                   drafter: str = 'drafter') -> list[list[int]]:
  """Token-id rows of text or token-id prompts, checked against the vocabulary and the
  model context (ValueError naming the problem): a verify step reaches `num_draft` tokens
  past the last committed one, so prompt + max_new_tokens + num_draft must fit it."""
  if isinstance(prompts, (str, bytes)) or not len(prompts):
    raise ValueError('prompts must be a non-empty list of strings or token-id lists')
  ids = []
  for p in prompts:
    if isinstance(p, str):
      row = tokenizer.encode(p)
    else:
      try:
        row = [int(t) for t in p]
      except (TypeError, ValueError) as e:
        raise ValueError(f'a prompt must be a string or a list of token ids, got {p!r:.60}') \
            from e
    if not row:
      raise ValueError('empty prompt: give prompt text or token ids')
    bad = [t for t in row if not 0 <= t < vocab_size]
    if bad:
      raise ValueError(f'prompt token ids {bad[:5]} out of range for vocab size {vocab_size}')
    if len(row) + max_new_tokens + num_draft > max_total:
      drafts = f' + num_draft={num_draft} ({drafter})' if num_draft else ''
      raise ValueError(f'prompt of {len(row)} tokens + max_new_tokens={max_new_tokens}'
                       f'{drafts} exceeds the model context of {max_total} tokens')
    ids.append(row)
  return ids


def row_tokens(tokens_BL: np.ndarray, end_B, start_B=None) -> list[list[int]]:
  """Per-row lists tokens[b, start_b:end_b] (start 0 when not given)."""
  start_B = np.zeros_like(end_B) if start_B is None else start_B
  return [tokens_BL[b, start_B[b]:end_B[b]].tolist() for b in range(len(end_B))]


def read_committed(state, sequences: list, num_B) -> tuple:
  """Appends to each row's list what `state` committed after its num_B tokens; returns the
  state's (num_tokens_B, done_B) as host arrays."""
  from dspec import distributed
  tokens_BL, new_B, done_B = distributed.host_values(
      (state.tokens_BL, state.num_tokens_B, state.done_B))
  for b, seq in enumerate(sequences):
    seq.extend(tokens_BL[b, num_B[b]:new_B[b]].tolist())
  return new_B, done_B


def generated_ids(state) -> list[list[int]]:
  """Generated token ids of each row of a decode state (prompt excluded)."""
  import jax
  tokens, lens, nums = jax.device_get((state.tokens_BL, state.prompt_len_B,
                                       state.num_tokens_B))
  return row_tokens(tokens, nums, lens)
