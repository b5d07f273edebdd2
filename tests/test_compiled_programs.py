"""Compiled programs: dropped past the memory-mapping limit, program sets LRU-bounded."""

import jax
import jax.numpy as jnp
import pytest

from dspec import compiled_programs


@pytest.mark.slow
def test_release_only_past_the_limit():
  f = jax.jit(lambda x: x + 1)
  f(jnp.ones(3))
  count = compiled_programs.memory_map_count()
  assert count is not None and count > 0
  assert not compiled_programs.release_if_many_maps(limit=count + 10_000)
  assert f._cache_size() == 1
  assert compiled_programs.release_if_many_maps(limit=0)
  assert f._cache_size() == 0


def test_program_sets_go_least_recently_used_first(monkeypatch):
  """Past MAX_PROGRAM_SETS sets (per engine and shape) the least recently used goes, and
  its executables with it."""
  monkeypatch.setattr(compiled_programs, 'MAX_PROGRAM_SETS', 2)
  built = []

  @compiled_programs.ProgramCache
  def programs(scale):
    built.append(scale)
    return {'f': jax.jit(lambda x: x * scale)}

  first = programs(2, (3,))
  first['f'](jnp.ones(3))
  assert programs(2, (3,)) is first
  programs(3, (3,))
  programs(2, (3,))                        # used last: (3, (3,)) is the oldest now
  programs(2, (4,))
  assert len(programs) == 2 and first['f']._cache_size() == 1 and built == [2, 3, 2]
  programs(4, (3,))
  assert first['f']._cache_size() == 0 and built == [2, 3, 2, 4]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_rerun_loads_every_program_from_the_persistent_cache(tmp_path):
  """The second run of a job compiles nothing new: every program comes from the cache."""
  import json
  import os
  import subprocess
  import sys

  from conftest import REPO_ROOT

  cache = tmp_path / 'xla'

  def decode(i):
    metrics = tmp_path / f'm{i}.json'
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, 'scripts', 'decode.py'),
         '--config=configs/tiny.py', '--prompt_ids=1,2,3,1,2,3,1,2', '--config.drafter=ngram',
         '--config.max_new_tokens=8', '--config.verify_length=fixed',
         '--config.timing_repeats=1', f'--compilation_cache_dir={cache}',
         f'--metrics_json={metrics}'],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(metrics.read_text()), sorted(p.name for p in cache.iterdir())

  first, cached = decode(0)
  assert len(cached) >= 3                    # prefill, the speculative step, AR
  second, cached_again = decode(1)
  assert cached_again == cached              # nothing compiled anew
  assert second['output_ids'] == first['output_ids']


@pytest.mark.multiprocess
@pytest.mark.slow
def test_an_empty_cache_dir_turns_the_cache_off(tmp_path):
  import subprocess
  import sys

  code = ('import sys; from absl import flags; from dspec import cli\n'
          'import jax\n'
          'def main(argv): print(jax.config.jax_compilation_cache_dir)\n'
          'cli.run(main)\n')
  proc = subprocess.run([sys.executable, '-c', code, '--compilation_cache_dir='],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == 'None'


def test_an_evicted_program_set_drops_its_warm_up_notes(monkeypatch):
  """What the host loop noted as warmed (`SpeculativeEngine.warm_marks`) goes with the
  programs, so a set the LRU dropped is warmed again, not trusted."""
  monkeypatch.setattr(compiled_programs, 'MAX_PROGRAM_SETS', 1)
  cache = compiled_programs.ProgramCache(lambda engine: {'f': jax.jit(lambda x: x + 1)})
  cache('a', (1,)).setdefault('warm', set()).add(4)
  assert cache('a', (1,))['warm'] == {4}
  cache('b', (1,))   # evicts a's set, notes included
  assert 'warm' not in cache('a', (1,))
