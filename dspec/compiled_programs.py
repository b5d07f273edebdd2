"""Bounding what compiled XLA:CPU programs hold in a long-lived process.

XLA:CPU maps every compiled program's code in several memory mappings. A process that
compiles many programs (the whole test suite, a family benchmark over many drafters and
sampling specs) passes the kernel's vm.max_map_count (65530 by default), and the compiler
then fails with "Cannot allocate memory" or segfaults. `release_if_many_maps` drops the
compiled programs (they recompile on next use) once the process holds `limit` mappings.
"""

from __future__ import annotations

import gc

import jax

MAX_MEMORY_MAPS = 40_000


def memory_map_count() -> int | None:
  """Mappings of this process (/proc/self/maps lines), or None without procfs."""
  try:
    with open('/proc/self/maps') as f:
      return sum(1 for _ in f)
  except OSError:
    return None


def release_if_many_maps(limit: int = MAX_MEMORY_MAPS) -> bool:
  """Clears jax's compiled-program caches past `limit` mappings; True if it did."""
  count = memory_map_count()
  if count is None or count <= limit:
    return False
  jax.clear_caches()
  gc.collect()
  return True
