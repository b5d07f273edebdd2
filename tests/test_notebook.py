"""notebooks/quickstart.ipynb: every code cell runs, on the tiny preset."""

import os

import matplotlib
import nbformat

from conftest import REPO_ROOT

matplotlib.use('Agg')


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
