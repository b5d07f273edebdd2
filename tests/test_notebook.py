"""notebooks/quickstart.ipynb: every code cell runs, on the tiny preset."""

import os

import matplotlib
import nbformat
import pytest

from conftest import REPO_ROOT

matplotlib.use('Agg')


def _code_cells():
  nb = nbformat.read(os.path.join(REPO_ROOT, 'notebooks', 'quickstart.ipynb'), as_version=4)
  return [cell.source for cell in nb.cells if cell.cell_type == 'code']


def test_quickstart_code_cells_are_python_and_take_their_settings_from_the_environment():
  """The quick check's look at the notebook: every code cell compiles (no shell or magic
  lines, which exec would refuse), and it reads the settings the full run below sets."""
  cells = _code_cells()
  assert cells
  for i, source in enumerate(cells):
    compile(source, f'quickstart.ipynb code cell {i}', 'exec')
  text = '\n'.join(cells)
  for name in ('DSPEC_QUICKSTART_PRESET', 'DSPEC_QUICKSTART_WORKDIR', 'DSPEC_REPO'):
    assert f"os.environ.get('{name}'" in text, name


@pytest.mark.slow
def test_quickstart_code_cells_run(tmp_path, monkeypatch):
  monkeypatch.setenv('DSPEC_QUICKSTART_PRESET', 'tiny')
  monkeypatch.setenv('DSPEC_QUICKSTART_WORKDIR', str(tmp_path))
  monkeypatch.setenv('DSPEC_REPO', REPO_ROOT)
  monkeypatch.chdir(REPO_ROOT)
  nb = nbformat.read(os.path.join(REPO_ROOT, 'notebooks', 'quickstart.ipynb'), as_version=4)
  namespace = {}
  for cell in nb.cells:
    if cell.cell_type == 'code':
      exec(compile(cell.source, 'quickstart.ipynb', 'exec'), namespace)
  assert namespace['report']['lossless'] is True
  assert namespace['fresh']['lossless'] is True
  assert namespace['result']['steps'] > 0
