"""Logit processing (temperature, top-k, top-p) shared by AR sampling and verification.

Target rows, bonus rows and sampled draft rows all go through `processed_probs`, so the
speculative output distribution is exactly the one plain sampling would give.

Top-p keeps the smallest prefix of the tokens sorted by probability whose mass reaches
top_p, and every token tied with the last one kept. Equivalently, token j is kept iff the
mass of the tokens strictly more probable than j is < top_p. No full-vocabulary sort: the
cut is read from a partial top-k when the nucleus fits in it (or top-k is on), otherwise it
is found by an exact bisection over the float bit patterns of the probabilities. Sums run
in another order than a sorted cumsum, so a token whose preceding mass equals top_p to
within float rounding may fall on either side; everything else matches the sort.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
  """Static sampling knobs (hashable; part of the compiled program).

  greedy: argmax decoding (temperature 0). top_k: 0 disables. use_top_p: whether the
  runtime `top_p` array is applied (kept static so greedy/plain sampling skip the sort).
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


# Top-p reads its cut from the `_HEAD` largest probabilities when the nucleus fits there.
_HEAD = 32


def processed_probs(logits_NV, spec: SamplingSpec, temperature, top_p):
  """Probabilities after temperature, top-k and top-p (fp32). Not used when greedy."""
  logits = logits_NV.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
  vocab = logits.shape[-1]
  top_idx = None
  if spec.top_k and spec.top_k < vocab:
    top_vals, top_idx = jax.lax.top_k(logits, spec.top_k)
    logits = jnp.where(logits >= top_vals[..., -1:], logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  if spec.use_top_p:
    if top_idx is not None:   # the nucleus lies inside the top-k set (ties keep the rest)
      threshold, _ = _prefix_cut(jnp.take_along_axis(probs, top_idx, axis=-1), top_p)
    else:
      threshold = _top_p_threshold(probs, top_p)
    probs = jnp.where(probs >= threshold, probs, 0.0)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
  return probs


def _prefix_cut(sorted_desc, top_p):
  """(threshold, complete) from probabilities sorted in descending order.

  threshold is the smallest probability of the prefix whose preceding mass is < top_p;
  complete says the prefix ended inside `sorted_desc` (so the threshold is final).
  """
  cum_before = jnp.cumsum(sorted_desc, axis=-1) - sorted_desc
  kept = cum_before < top_p
  threshold = jnp.min(jnp.where(kept, sorted_desc, jnp.inf), axis=-1, keepdims=True)
  return threshold, ~kept[..., -1:]


def _top_p_threshold(probs, top_p):
  """Smallest kept probability: from the top `_HEAD`, else from an exact search."""
  vocab = probs.shape[-1]
  head = jax.lax.top_k(probs, min(_HEAD, vocab))[0]
  threshold, complete = _prefix_cut(head, top_p)
  if head.shape[-1] == vocab:
    return threshold
  return jax.lax.cond(
      jnp.all(complete), lambda: threshold,
      lambda: jnp.where(complete, threshold, _search_threshold(probs, top_p, head[..., -1:])))


def _search_threshold(probs, top_p, hi):
  """Exact top-p threshold by bisection on the int32 bit patterns of the probabilities.

  Non-negative floats order like their bit patterns. Invariant per row: the mass strictly
  above `lo` is >= top_p and the mass strictly above `hi` is < top_p, so the threshold is
  a probability in (lo, hi]. A row stops once (lo, hi] holds one distinct value (one token,
  or adjacent bit patterns); the kept tokens are then exactly those > lo. `hi` must satisfy
  the invariant (the `_HEAD`-th largest probability when the head is all kept).
  """
  vocab = probs.shape[-1]
  bits = jax.lax.bitcast_convert_type(probs, jnp.int32)

  def above(b):
    over = bits > b
    return (jnp.sum(jnp.where(over, probs, 0.0), axis=-1, keepdims=True),
            jnp.sum(over, axis=-1, keepdims=True, dtype=jnp.int32))

  # Tokens below (1 - top_p) / vocab hold at most 1 - top_p together: start lo there when
  # the mass above it really reaches top_p (it may not, within rounding); else at -1
  # (below every probability, count = vocab).
  floor = jnp.broadcast_to((1.0 - jnp.asarray(top_p, jnp.float32)) / (2 * vocab), hi.shape)
  floor_b = jax.lax.bitcast_convert_type(floor, jnp.int32)
  floor_mass, floor_count = above(floor_b)
  use_floor = floor_mass >= top_p
  lo_b = jnp.where(use_floor, floor_b, -1)
  count_lo = jnp.where(use_floor, floor_count, vocab)
  hi_b = jax.lax.bitcast_convert_type(hi, jnp.int32)
  count_hi = above(hi_b)[1]

  def open_rows(c):
    lo_b, hi_b, count_lo, count_hi = c
    return (count_lo - count_hi > 1) & (hi_b - lo_b > 1)

  def step(c):
    lo_b, hi_b, count_lo, count_hi = c
    active = open_rows(c)
    mid_b = lo_b + (hi_b - lo_b) // 2
    mass, count = above(mid_b)
    to_hi = active & (mass < top_p)
    to_lo = active & ~(mass < top_p)
    return (jnp.where(to_lo, mid_b, lo_b), jnp.where(to_hi, mid_b, hi_b),
            jnp.where(to_lo, count, count_lo), jnp.where(to_hi, count, count_hi))

  lo_b = jax.lax.while_loop(lambda c: jnp.any(open_rows(c)), step,
                            (lo_b, hi_b, count_lo, count_hi))[0]
  return jax.lax.bitcast_convert_type(lo_b + 1, jnp.float32)   # smallest float > lo


def sample_from_probs(key, probs_NV):
  """One categorical sample per row; zero-probability tokens are never drawn."""
  logp = jnp.where(probs_NV > 0, jnp.log(jnp.maximum(probs_NV, 1e-38)), -jnp.inf)
  return jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)
