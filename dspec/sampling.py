"""Logit processing (temperature, top-k, top-p) shared by AR sampling and verification.

Target rows, bonus rows and sampled draft rows all go through `processed_probs`, so the
speculative output distribution is exactly the one plain sampling would give.

Top-p keeps the smallest prefix of the tokens sorted by probability whose mass reaches
top_p, and every token tied with the last one kept. Equivalently, token j is kept iff the
mass of the tokens strictly more probable than j is < top_p. No full-vocabulary sort: with
top-k on, the cut is read from the sorted top-k set; otherwise an exact search over the
float bit patterns of the probabilities finds it (`top_p_threshold`). Its sums run in
another order than a sorted cumsum, so a token whose preceding mass equals top_p to within
float rounding may fall on either side; every other token gets the sort's decision.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
  """Static sampling knobs (hashable; part of the compiled program).

  greedy: argmax decoding (temperature 0). top_k: 0 disables. use_top_p: whether the
  runtime `top_p` array is applied (kept static so greedy/plain sampling skip its search).
  """

  greedy: bool = True
  top_k: int = 0
  use_top_p: bool = False

  @classmethod
  def create(cls, temperature: float, top_k: int, top_p: float) -> 'SamplingSpec':
    if temperature < 0:
      raise ValueError(f'temperature must be >= 0, got {temperature}')
    if not 0.0 < top_p <= 1.0:
      raise ValueError(f'top_p must be in (0, 1], got {top_p}')
    if top_k < 0:
      raise ValueError(f'top_k must be >= 0, got {top_k}')
    return cls(greedy=temperature == 0, top_k=int(top_k), use_top_p=top_p < 1.0)


def _search_plan() -> tuple:
  """(row by row, probes per pass) of the top-p search. CPU: one row at a time (it stays in
  cache across passes), bisection. Accelerators: all rows at once, 15 probes (4 bits) per
  pass: a pass is one fused reduction, so fewer, wider passes save launches and loop
  syncs, while the probe work (rows x vocab x probes) stays small up to batch 64."""
  return (True, 1) if jax.default_backend() == 'cpu' else (False, 15)


def top_k(x, k: int):
  """`jax.lax.top_k` behind an optimization barrier. XLA lowers top-k to a sort plus a
  slice and turns that back into its fast TopK call only while nothing slices the result
  again; a later slice or scatter on the indices (e.g. `idx[..., -1]`) otherwise costs a
  full sort of the last axis (on CPU, 2.6 s against 0.03 s for 1920 × 8192)."""
  values, indices = jax.lax.top_k(x, k)   # one barrier each: on one over the pair, XLA's
  # SPMD partitioner aborts (hlo_casting_utils Check failed), e.g. a meshed DFlash eval.
  return jax.lax.optimization_barrier(values), jax.lax.optimization_barrier(indices)


def processed_probs(logits_NV, spec: SamplingSpec, temperature, top_p):
  """Probabilities after temperature, top-k and top-p (fp32). Not used when greedy."""
  logits = logits_NV.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
  vocab = logits.shape[-1]
  top_idx = None
  if spec.top_k and spec.top_k < vocab:
    top_vals, top_idx = top_k(logits, spec.top_k)
    logits = jnp.where(logits >= jnp.min(top_vals, axis=-1, keepdims=True), logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  if spec.use_top_p:
    if top_idx is not None:   # the cut lies inside the sorted top-k set (ties keep the rest)
      threshold = _prefix_threshold(jnp.take_along_axis(probs, top_idx, axis=-1), top_p)
    else:
      threshold = top_p_threshold(probs, top_p)
    probs = jnp.where(probs >= threshold, probs, 0.0)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
  return probs


def _prefix_threshold(sorted_desc, top_p):
  """Smallest probability of the prefix (of descending `sorted_desc`) whose preceding mass
  is < top_p; exact when the cut falls inside it."""
  cum_before = jnp.cumsum(sorted_desc, axis=-1) - sorted_desc
  return jnp.min(jnp.where(cum_before < top_p, sorted_desc, jnp.inf), axis=-1, keepdims=True)


def top_p_threshold(probs, top_p):
  """Exact top-p threshold [..., 1] of `probs` [..., V] (`_search_threshold`)."""
  row_by_row, pivots = _search_plan()
  top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), probs.shape[:-1] + (1,))
  if not row_by_row:
    return _search_threshold(probs, top_p, pivots)
  vocab = probs.shape[-1]
  rows = (probs.reshape(-1, 1, vocab), top_p.reshape(-1, 1, 1))
  return jax.lax.map(lambda r: _search_threshold(*r, pivots), rows).reshape(top_p.shape)


def _search_threshold(probs, top_p, pivots: int):
  """Exact top-p threshold [..., 1] of `probs` [..., V] by a search on float bit patterns.

  Non-negative floats order like their int32 bit patterns. Invariant per row: the mass
  strictly above `lo` is >= top_p and the mass strictly above `hi` is < top_p, so the
  threshold is a probability in (lo, hi]. Each pass probes `pivots` evenly spaced bit
  patterns inside (lo, hi) and keeps the sub-interval where the mass crosses top_p. A row
  is done once (lo, hi] holds one distinct value (one token, or adjacent bit patterns);
  the kept tokens are then exactly those > lo, i.e. >= the returned threshold (which may
  lie below the smallest kept probability).
  """
  vocab = probs.shape[-1]
  shape = probs.shape[:-1] + (1,)

  def above(pivots_b):
    """Mass and count of tokens strictly above each bit pattern in [..., K] (the count
    sums in fp32, exact below 2^24 tokens, and is faster than an int sum on CPU)."""
    over = probs[..., None, :] > jax.lax.bitcast_convert_type(pivots_b, jnp.float32)[..., None]
    return (jnp.sum(jnp.where(over, probs[..., None, :], 0.0), axis=-1),
            jnp.sum(jnp.where(over, 1.0, 0.0), axis=-1).astype(jnp.int32))

  # Tokens below (1 - top_p) / (2 vocab) hold under 1 - top_p together: start lo there
  # when the mass above it does reach top_p (within rounding it may not), else at -1
  # (below every probability). hi starts at 1.0 (mass above it: 0).
  floor_b = jax.lax.bitcast_convert_type((1.0 - top_p) / (2 * vocab), jnp.int32)
  lo_b = jnp.where(above(floor_b)[0] >= top_p, floor_b, -1)
  hi_b = jnp.full(shape, jax.lax.bitcast_convert_type(jnp.float32(1.0), jnp.int32))

  def split(lo_b, hi_b):
    """Probes inside (lo, hi), the counts above them, and how many lie left of the cut."""
    stride = jnp.maximum((hi_b - lo_b) // (pivots + 1), 1)
    probe_b = jnp.minimum(lo_b + stride * jnp.arange(1, pivots + 1), hi_b - 1)   # [..., K]
    mass, count = above(probe_b)
    return probe_b, count, jnp.sum(mass >= top_p, axis=-1, keepdims=True)

  pick = lambda x, i: jnp.take_along_axis(x, jnp.clip(i, 0, pivots - 1), axis=-1)

  def narrow(_, c):
    lo_b, hi_b = c
    probe_b, _, below = split(lo_b, hi_b)
    wide = hi_b - lo_b > 1
    return (jnp.where(wide & (below > 0), pick(probe_b, below - 1), lo_b),
            jnp.where(wide & (below < pivots), pick(probe_b, below), hi_b))

  def open_rows(c):
    lo_b, hi_b, count_lo, count_hi = c
    return (count_lo - count_hi > 1) & (hi_b - lo_b > 1)

  def step(c):
    lo_b, hi_b, count_lo, count_hi = c
    active = open_rows(c)
    probe_b, count, below = split(lo_b, hi_b)
    new_lo, new_hi = active & (below > 0), active & (below < pivots)
    return (jnp.where(new_lo, pick(probe_b, below - 1), lo_b),
            jnp.where(new_hi, pick(probe_b, below), hi_b),
            jnp.where(new_lo, pick(count, below - 1), count_lo),
            jnp.where(new_hi, pick(count, below), count_hi))

  # Rows nearly always need 12+ bits of narrowing before (lo, hi] isolates one value, so
  # the first passes skip the counts the stopping test needs (half a pass's cost).
  bits_per_pass = (pivots + 1).bit_length() - 1
  lo_b, hi_b = jax.lax.fori_loop(0, -(-12 // bits_per_pass), narrow, (lo_b, hi_b))
  counts = above(jnp.concatenate([jnp.maximum(lo_b, 0), hi_b], axis=-1))[1]
  count_lo = jnp.where(lo_b < 0, vocab, counts[..., :1])
  lo_b = jax.lax.while_loop(lambda c: jnp.any(open_rows(c)), step,
                            (lo_b, hi_b, count_lo, counts[..., 1:]))[0]
  return jax.lax.bitcast_convert_type(lo_b + 1, jnp.float32)   # smallest float > lo


def sample_from_probs(key, probs_NV):
  """One categorical sample per row; zero-probability tokens are never drawn."""
  logp = jnp.where(probs_NV > 0, jnp.log(jnp.maximum(probs_NV, 1e-38)), -jnp.inf)
  return jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)
