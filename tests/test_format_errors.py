"""Every unreadable model file is one error line naming it: a `model.safetensors` that is a
directory, truncated or corrupt safetensors, a safetensors index or config.json that is not
JSON, not an object, binary or a directory, a tokenizer.json that is a directory; for a
drafter directory, a Hugging Face target and `convert_hf.py`."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from flax import nnx

from conftest import REPO_ROOT, TINY
from dspec.hf_export import export_to_hf
from dspec.hf_import import load_hf_model
from dspec.models.eagle3 import Eagle3Config, Eagle3Model
from dspec.models.formats.eagle3 import load_eagle3, save_speculators
from dspec.models.transformer import Transformer
from dspec.tokenizer import load_tokenizer


@pytest.fixture(scope='module')
def sources(tmp_path_factory):
  """An EAGLE-3 speculators directory and a HF target directory, both valid."""
  root = tmp_path_factory.mktemp('sources')
  save_speculators(root / 'drafter', Eagle3Model(
      Eagle3Config(target_layer_ids=(1, 0), final_tap_normed=True), TINY, rngs=nnx.Rngs(0)))
  export_to_hf(Transformer(TINY, rngs=nnx.Rngs(1)), root / 'hf')
  return root


def _load(path, kind):
  if kind == 'drafter':
    return load_eagle3(str(path), target_cfg=TINY)
  return load_hf_model(str(path))


def _corrupt(path, what):
  """Breaks one file of the directory `path`; returns the file the error must name."""
  weights = path / 'model.safetensors'
  config = path / 'config.json'
  data = weights.read_bytes()
  if what == 'weights_dir':
    weights.unlink()
    weights.mkdir()
    return weights
  if what in ('truncated', 'header_only', 'garbage', 'empty'):
    weights.write_bytes({'truncated': data[:len(data) // 2], 'header_only': data[:12],
                         'garbage': os.urandom(64), 'empty': b''}[what])
    return weights
  if what == 'index_dir':
    (path / 'model.safetensors.index.json').mkdir()
    return path / 'model.safetensors.index.json'
  if what == 'index_garbage':
    (path / 'model.safetensors.index.json').write_text('{"weight_map": ')
    return path / 'model.safetensors.index.json'
  config.unlink()
  if what == 'config_dir':
    config.mkdir()
  else:
    config.write_bytes({'config_json': b'{"model_type": "qwen3",', 'config_list': b'[]',
                        'config_binary': b'\xff\xfe\x00\x81'}[what])
  return config


CASES = ['weights_dir', 'truncated', 'header_only', 'garbage', 'empty', 'index_dir',
         'index_garbage', 'config_dir', 'config_json', 'config_list', 'config_binary']


@pytest.mark.parametrize('kind', ['drafter', 'hf'])
@pytest.mark.parametrize('what', CASES)
def test_a_broken_file_is_one_line_naming_it(sources, tmp_path, kind, what):
  path = tmp_path / kind
  shutil.copytree(sources / kind, path)
  _load(path, kind)
  named = _corrupt(path, what)
  with pytest.raises(ValueError) as e:
    _load(path, kind)
  message = str(e.value)
  assert str(named) in message and '\n' not in message, message


def test_tokenizer_json_that_is_a_directory_is_named(tmp_path):
  (tmp_path / 'tokenizer.json').mkdir()
  with pytest.raises(ValueError, match='tokenizer.json: not a readable file'):
    load_tokenizer(str(tmp_path), 300)
  (tmp_path / 'tokenizer.json').rmdir()
  (tmp_path / 'generation_config.json').mkdir()
  with pytest.raises(ValueError, match='generation_config.json: cannot be read'):
    load_tokenizer(str(tmp_path), 300)


@pytest.mark.multiprocess
def test_convert_hf_names_a_weights_directory(sources, tmp_path):
  shutil.copytree(sources / 'hf', tmp_path / 'hf')
  named = _corrupt(tmp_path / 'hf', 'weights_dir')
  proc = subprocess.run([sys.executable, os.path.join(REPO_ROOT, 'scripts', 'convert_hf.py'),
                         f'--hf_dir={tmp_path / "hf"}', f'--out={tmp_path / "out"}'],
                        capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode != 0 and len(lines) == 1 and lines[0].startswith('error: '), \
      proc.stderr[-2000:]
  assert str(named) in lines[0]
  assert not (tmp_path / 'out').exists()
