"""Compiled XLA programs: a persistent cache across runs, and a bound on what one process holds.

`enable_persistent_cache` points JAX's compilation cache at a folder, so a second run of the
same job loads its programs instead of recompiling them (`--compilation_cache_dir`, '' = off).

XLA:CPU maps every compiled program's code in several memory mappings. A process that
compiles many programs (the whole test suite, a family benchmark over many drafters and
sampling specs) passes the kernel's vm.max_map_count (65530 by default), and the compiler
then fails with "Cannot allocate memory" or segfaults. `release_if_many_maps` drops the
compiled programs (they recompile on next use) once the process holds `limit` mappings.
`ProgramCache` bounds the decoding engines' program sets (an LRU of `MAX_PROGRAM_SETS`), so
a long-lived process (a notebook calling `dspec.generate` on ever new shapes) stays flat;
`counting_compiles` lists what XLA compiles meanwhile (tests, `scripts/bench_buckets.py`).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import os
from typing import Callable, Hashable, Iterator

import jax

MAX_MEMORY_MAPS = 40_000
MAX_PROGRAM_SETS = 128
BACKEND_COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'
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


@contextlib.contextmanager
def counting_compiles() -> Iterator[list]:
  """A list that collects the name of every program XLA compiles inside the block."""
  names = []

  def listener(event, seconds, **kw):
    if event == BACKEND_COMPILE_EVENT:
      names.append(kw.get('fun_name', ''))

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield names
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


class ProgramCache:
  """`build(engine)` (a dict of jitted functions) cached per engine and decode-state
  shape, so that each set holds the executables of one shape; least recently used first
  out past `MAX_PROGRAM_SETS` (read at each insertion, so settable): an evicted set's
  functions drop their executables (`clear_cache`), and with them their memory mappings."""

  def __init__(self, build: Callable[[Hashable], dict]):
    self._build = build
    self._sets = collections.OrderedDict()

  def __call__(self, engine: Hashable, shape: tuple) -> dict:
    key = (engine, shape)
    programs = self._sets.get(key)
    if programs is not None:
      self._sets.move_to_end(key)
      return programs
    programs = self._sets[key] = self._build(engine)
    while len(self._sets) > MAX_PROGRAM_SETS:
      for fn in self._sets.popitem(last=False)[1].values():
        if hasattr(fn, 'clear_cache'):   # a set may hold other notes (`warm_marks`)
          fn.clear_cache()
    return programs

  def __len__(self) -> int:
    return len(self._sets)
