"""Timing helpers for benchmarks: warm-up, then the median of several runs."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def median_times(fns, repeats: int = 5, warmup: int = 1) -> list:
  """Median wall seconds of each zero-argument function (results are blocked on) after
  `warmup` calls of each; the timed calls are interleaved round by round, so drift in
  machine load hits every function alike."""
  for _ in range(warmup):
    for fn in fns:
      jax.block_until_ready(fn())
  times = [[] for _ in fns]
  for _ in range(repeats):
    for i, fn in enumerate(fns):
      t = time.perf_counter()
      jax.block_until_ready(fn())
      times[i].append(time.perf_counter() - t)
  return [statistics.median(t) for t in times]


def median_time(fn, repeats: int = 5, warmup: int = 1) -> float:
  """Median wall seconds of `fn()` (results are blocked on) after `warmup` calls."""
  return median_times([fn], repeats, warmup)[0]


def read_bandwidth_bytes_per_s(num_bytes: int, repeats: int = 7) -> float:
  """Achievable read bandwidth: a jitted reduction over a buffer of `num_bytes`."""
  x = jnp.ones((num_bytes // 4,), jnp.float32)
  reduce = jax.jit(lambda a: jnp.sum(a))
  return num_bytes / median_time(lambda: reduce(x), repeats=repeats, warmup=2)
