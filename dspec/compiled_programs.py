"""Compiled XLA programs: a persistent cache across runs, and a bound on what one process holds.

`enable_persistent_cache` points JAX's compilation cache at a folder, so a second run of the
same job loads its programs instead of recompiling them (`--compilation_cache_dir`, '' = off).

XLA:CPU maps every compiled program's code in several memory mappings. A process that
compiles many programs (the whole test suite, a family benchmark over many drafters and
sampling specs) passes the kernel's vm.max_map_count (65530 by default), and the compiler
then fails with "Cannot allocate memory" or segfaults. `release_if_many_maps` drops the
compiled programs (they recompile on next use) once the process holds `limit` mappings.
"""

from __future__ import annotations

import gc
import os

import jax

MAX_MEMORY_MAPS = 40_000
DEFAULT_CACHE_DIR = os.path.join(
    os.environ.get('XDG_CACHE_HOME', os.path.join(os.path.expanduser('~'), '.cache')),
    'dspec', 'xla')
CACHE_MAX_BYTES = 2 << 30


def enable_persistent_cache(cache_dir: str, max_bytes: int = CACHE_MAX_BYTES) -> None:
  """Caches every compiled program under `cache_dir` (created if missing), LRU-bounded."""
  os.makedirs(cache_dir, exist_ok=True)
  jax.config.update('jax_compilation_cache_dir', cache_dir)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  jax.config.update('jax_compilation_cache_max_size', max_bytes)


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
