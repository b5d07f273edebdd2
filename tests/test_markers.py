"""The quick check (`pytest -m 'not slow and not multiprocess'`) keeps a test of every test
module, and a misspelt marker is an error, not a silently empty selection."""

import glob
import os

import pytest

from conftest import MARKERS, QUICK_TESTS_BY_MODULE, REPO_ROOT


def _test_modules() -> set:
  tests = os.path.join(REPO_ROOT, 'tests')
  return {os.path.relpath(path, REPO_ROOT)
          for path in glob.glob(os.path.join(tests, '**', 'test_*.py'), recursive=True)}


def test_every_module_has_a_quick_test(request):
  """Counted over this session's collection, before `-m` deselects (tests/conftest.py)."""
  counts = request.config.stash.get(QUICK_TESTS_BY_MODULE, {})
  unseen = _test_modules() - set(counts)
  if unseen:
    pytest.skip(f'this session collected only part of tests/ ({len(unseen)} modules not): '
                'run `pytest` or the quick check')
  without = sorted(module for module, quick in counts.items() if not quick)
  assert not without, f'modules with every test marked {" or ".join(MARKERS)}: {without}'


def test_markers_are_registered_and_strict(request):
  registered = {line.split(':')[0] for line in request.config.getini('markers')}
  assert set(MARKERS) <= registered
  assert request.config.option.strict_markers   # pytest.ini: a typo'd marker fails collection
