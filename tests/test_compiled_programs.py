"""Compiled programs are dropped only past the memory-mapping limit."""

import jax
import jax.numpy as jnp

from dspec import compiled_programs


def test_release_only_past_the_limit():
  f = jax.jit(lambda x: x + 1)
  f(jnp.ones(3))
  count = compiled_programs.memory_map_count()
  assert count is not None and count > 0
  assert not compiled_programs.release_if_many_maps(limit=count + 10_000)
  assert f._cache_size() == 1
  assert compiled_programs.release_if_many_maps(limit=0)
  assert f._cache_size() == 0
