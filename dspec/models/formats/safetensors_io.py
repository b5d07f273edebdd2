"""Safetensors model directories: which file holds each tensor, reading a model's params
from them, writing `config.json` + `model.safetensors`, and refusing a directory that holds
two models' files (`check_one_model`).

Stored tensors are torch's layout: a dspec kernel [in, out] is stored transposed as a
`.weight` [out, in]; every reader and writer says per param whether it is transposed.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from dspec import files
from dspec.checkpoint import is_checkpoint_dir, leaf_paths
from dspec.errors import CheckpointError

SINGLE_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'
_CHECKPOINT_ITEMS = ('state', 'metadata')   # a dspec (orbax) checkpoint's


def open_safetensors(path: str):
  """`safe_open` of one file; FileNotFoundError or ValueError naming it when it cannot."""
  if not os.path.exists(path):
    raise FileNotFoundError(f'{path}: safetensors file is missing')
  if not os.path.isfile(path):
    raise ValueError(f'{path}: is a directory or special file, not a safetensors file')
  try:
    return safe_open(path, framework='flax')
  except SafetensorError as e:
    raise ValueError(f'{path}: unreadable safetensors file ({e})') from None


def read_tensor(file: str, name: str, error: type = ValueError) -> np.ndarray:
  """Tensor `name` of the safetensors `file` as a numpy array; `error` naming both when it
  cannot be read."""
  with open_safetensors(file) as f:
    try:
      return np.asarray(f.get_tensor(name))
    except SafetensorError as e:
      raise error(f'{file}: cannot read tensor {name!r} ({e})') from None


def tensor_files(directory: str) -> dict[str, str]:
  """Maps every tensor name of a model directory (one file or an index) to its file."""
  index_path = os.path.join(directory, INDEX_FILE)
  single_path = os.path.join(directory, SINGLE_FILE)
  if os.path.exists(index_path):
    try:
      with open(index_path) as f:
        weight_map = json.load(f)['weight_map']
      return {name: os.path.join(directory, file) for name, file in weight_map.items()}
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError,
            AttributeError) as e:
      raise ValueError(f'{index_path}: not a safetensors index ({e!r})') from None
    except OSError as e:
      raise ValueError(f'{index_path}: cannot be read ({e.strerror or e})') from None
  if os.path.exists(single_path):
    with open_safetensors(single_path) as f:
      return {name: single_path for name in f.keys()}
  raise FileNotFoundError(f'{directory}: no {SINGLE_FILE} or {INDEX_FILE}')


def read_params(model: nnx.Module, tensors: dict, locate: Callable, where: str,
                error: type = ValueError) -> set:
  """Reads every param of the (abstract) `model` in place; returns the keys it read.

  tensors: {key: (file, stored name)}; locate(dotted param path) -> (key, transposed).
  A key not in `tensors` (named with `where`), an unreadable tensor or a shape mismatch
  (named with its file) raises `error`.
  """
  state = nnx.state(model, nnx.Param)
  abstract = nnx.to_pure_dict(state)
  used = set()
  with contextlib.ExitStack() as stack:
    handles = {}

    def read(param: str, leaf):
      key, transpose = locate(param)
      if key not in tensors:
        raise error(f'{where}: tensor {key!r} is missing')
      used.add(key)
      file, name = tensors[key]
      if file not in handles:
        handles[file] = stack.enter_context(open_safetensors(file))
      try:
        tensor = handles[file].get_tensor(name)
      except SafetensorError as e:
        raise error(f'{file}: cannot read tensor {name!r} ({e})') from None
      expected = leaf.shape[::-1] if transpose else leaf.shape
      if tuple(tensor.shape) != tuple(expected):
        raise error(f'{file}: tensor {name!r} has shape {tuple(tensor.shape)}, '
                    f'expected {tuple(expected)}')
      return jnp.asarray(tensor.T if transpose else tensor, dtype=leaf.dtype)

    params = jax.tree.unflatten(jax.tree.structure(abstract),
                                [read(p, leaf) for p, leaf in leaf_paths(abstract).items()])
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)
  return used


def stored_tensors(model: nnx.Module, stored_name: Callable, dtype: str) -> dict:
  """Every param of `model` as a `dtype` numpy array under its stored name;
  stored_name(dotted param path) -> (name, transposed)."""
  tensors = {}
  for param, leaf in leaf_paths(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items():
    name, transpose = stored_name(param)
    tensors[name] = np.asarray(jnp.asarray(leaf.T if transpose else leaf, dtype))
  return tensors


def model_files(path) -> tuple[list, list]:
  """(a dspec checkpoint's items, a published form's files) in directory `path`: state/
  and metadata/; config.json, safetensors files and their index."""
  names = set(os.listdir(path))
  published = {n for n in names
               if n in ('config.json', INDEX_FILE) or n.endswith('.safetensors')}
  return sorted(names & set(_CHECKPOINT_ITEMS)), sorted(published)


def check_one_model(path) -> None:
  """CheckpointError naming `path` and what it found when the directory holds two models'
  files (read as either, it would silently give one of them): a dspec checkpoint beside
  a config.json or safetensors, or model.safetensors beside a sharded index."""
  path = os.fspath(path)
  if '://' in path or not os.path.isdir(path):
    return
  items, published = model_files(path)
  if items and published:
    found = (f'a dspec checkpoint ({", ".join(i + "/" for i in items)}) and '
             f'{", ".join(published)}')
  elif SINGLE_FILE in published and INDEX_FILE in published:
    found = f'both {os.path.join(path, SINGLE_FILE)} and {os.path.join(path, INDEX_FILE)}'
  else:
    return
  raise CheckpointError(f'{path}: holds two models\' files, {found}; refusing to guess '
                        'which one to load (move one of them to a directory of its own)')


def is_export(path) -> bool:
  """Whether directory `path` holds an earlier `write_model_dir` output and nothing else: a
  dspec-marked model.safetensors beside config.json."""
  try:
    names = set(os.listdir(path)) - {files.LOCK_FILE}
  except OSError:
    return False
  return (names == {SINGLE_FILE, 'config.json'}
          and files.written_by_dspec(os.path.join(path, SINGLE_FILE)))


def write_model_dir(path, config: dict, tensors: dict, dtype: str, *, force: bool = False,
                    what: str = 'drafter export') -> None:
  """Writes `config.json` (with its `dtype` key set) and `model.safetensors` as directory
  `path`, both or neither (`files.write_dir`); the safetensors header marks the file as
  dspec's `what` (`dspec.files.written_by_dspec`), so a later export may replace it.

  An earlier export at `path` (`is_export`) is replaced whole, and so is a dspec checkpoint
  with `force`; into any other directory only the two files go, and one that holds another
  model's files is refused (so it never holds two models).
  """
  path = os.fspath(path)
  replace = os.path.isdir(path) and (is_export(path) or (force and is_checkpoint_dir(path)))
  if os.path.isdir(path) and not replace:
    items, published = model_files(path)
    others = items + [n for n in published if n not in (SINGLE_FILE, 'config.json')]
    if others:
      raise files.OutputPathError(
          f'{path}: holds another model\'s files ({", ".join(others)}); refusing to write '
          'a second model beside them (give a new directory)')
  metadata = {'format': 'pt', files.OUTPUT_KEY: what}

  def write(tmp):
    os.makedirs(tmp)
    files.write_atomic(os.path.join(tmp, SINGLE_FILE),
                       lambda file: save_file(tensors, file, metadata=metadata))
    files.write_json_atomic(os.path.join(tmp, 'config.json'), dict(config, dtype=dtype),
                            indent=2)

  files.write_dir(path, write, replace=replace)
