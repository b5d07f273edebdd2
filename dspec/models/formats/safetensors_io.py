"""Safetensors model directories: which file holds each tensor, reading a model's params
from them, writing `config.json` + `model.safetensors`.

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

from dspec.checkpoint import leaf_paths
from dspec.files import OUTPUT_KEY, write_atomic, write_json_atomic

SINGLE_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'


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


def write_model_dir(path, config: dict, tensors: dict, dtype: str) -> None:
  """Writes `config.json` (with its `dtype` key set) and `model.safetensors` into the
  directory `path`, each atomically; the safetensors header marks the file as dspec's
  (`dspec.files.written_by_dspec`), so a later export may replace it."""
  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  metadata = {'format': 'pt', OUTPUT_KEY: 'drafter export'}
  write_atomic(os.path.join(path, SINGLE_FILE),
               lambda tmp: save_file(tensors, tmp, metadata=metadata))
  write_json_atomic(os.path.join(path, 'config.json'), dict(config, dtype=dtype), indent=2)
