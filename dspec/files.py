"""Safe output writes and directory locks.

`write_atomic` replaces a regular (or new) file atomically, so a reader never sees a
half-written output. It never replaces anything else: a symlink is written through (its
target gets the bytes, the link stays), a character device or FIFO (`/dev/stdout`,
`/dev/null`) is written through, and a directory, block device or socket is refused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import stat
import tempfile
from typing import Callable


class OutputPathError(OSError):
  """An output path names something that must not be written or replaced."""


def _kind(mode: int) -> str:
  if stat.S_ISDIR(mode):
    return 'a directory'
  if stat.S_ISBLK(mode):
    return 'a block device'
  if stat.S_ISSOCK(mode):
    return 'a socket'
  return 'a special file'


def _write_through(path: str, write: Callable[[str], None]) -> None:
  """`write` into a private temporary file, then copy its bytes into `path` (not replaced)."""
  fd, tmp = tempfile.mkstemp(prefix='dspec-out-')
  os.close(fd)
  try:
    write(tmp)
    with open(tmp, 'rb') as src, open(path, 'wb') as dst:
      shutil.copyfileobj(src, dst)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def write_atomic(path: str, write: Callable[[str], None]) -> None:
  """`write(tmp_path)`, then puts the bytes at `path`; on failure `path` is untouched.

  A regular or new `path` is replaced atomically (rename of a sibling temporary file, the
  old file's permissions kept). A symlink, character device or FIFO is written through in
  place (its inode is kept). Directories, block devices and sockets raise OutputPathError.
  """
  path = os.fspath(path)
  if not path:
    raise OutputPathError('empty output path')
  try:
    st = os.stat(path)   # follows symlinks
  except FileNotFoundError:
    st = None
  if st is not None and not stat.S_ISREG(st.st_mode):
    if stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode):
      _write_through(path, write)
      return
    raise OutputPathError(f'{path}: is {_kind(st.st_mode)}, not a file; refusing to write it')
  if os.path.islink(path):
    _write_through(path, write)
    return
  tmp = f'{path}.tmp{os.getpid()}'
  try:
    write(tmp)
    if st is not None:
      shutil.copymode(path, tmp)
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


class LockedError(OSError):
  """Another process holds the lock of a directory."""


_held_locks: dict[str, int] = {}


@contextlib.contextmanager
def directory_lock(directory: str, what: str):
  """Holds an exclusive lock on `directory` (its `.lock` file) for the `with` block.

  Another process asking for the same lock gets LockedError at once; the same process may
  nest it. The lock dies with its process (even on kill -9), so it never goes stale.
  """
  if os.path.exists(directory) and not os.path.isdir(directory):
    raise OutputPathError(f'{directory}: exists and is not a directory')
  os.makedirs(directory, exist_ok=True)
  key = os.path.realpath(directory)
  if key in _held_locks:
    _held_locks[key] += 1
    try:
      yield
    finally:
      _held_locks[key] -= 1
    return
  path = os.path.join(directory, '.lock')
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        raise
      holder = os.pread(fd, 64, 0).decode(errors='replace').strip() or '?'
      raise LockedError(f'{directory}: another {what} (pid {holder}) is using this directory; '
                        'wait for it to finish or use another directory') from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f'{os.getpid()}\n'.encode(), 0)
    _held_locks[key] = 1
    try:
      yield
    finally:
      del _held_locks[key]
  finally:
    os.close(fd)
