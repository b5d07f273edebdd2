"""Atomic file writes: a reader never sees a half-written output file."""

from __future__ import annotations

import json
import os
from typing import Callable


def write_atomic(path: str, write: Callable[[str], None]) -> None:
  """`write(tmp_path)`, then renames tmp_path to `path`; on failure `path` is untouched."""
  tmp = f'{path}.tmp{os.getpid()}'
  try:
    write(tmp)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def write_text_atomic(path: str, text: str) -> None:
  """Writes `text` to `path` atomically."""
  def write(tmp):
    with open(tmp, 'w') as f:
      f.write(text)
  write_atomic(path, write)


def write_json_atomic(path: str, obj, indent: int = 1) -> None:
  """Writes `obj` as JSON to `path` atomically (creating the parent directory)."""
  parent = os.path.dirname(os.path.abspath(path))
  os.makedirs(parent, exist_ok=True)

  def write(tmp):
    with open(tmp, 'w') as f:
      json.dump(obj, f, indent=indent)

  write_atomic(path, write)
