"""The output-path policy: what dspec may write, replace or refuse, and how it writes.

One policy for every script and the API (docs/DESIGN.md, "Bad input"):

- a file dspec wrote (`written_by_dspec`: a JSON object carrying `OUTPUT_KEY`, or a
  safetensors file whose header names dspec) may be replaced; any other existing file is
  refused unless the user forces it (`check_output_file`);
- a symlink is refused everywhere, unless it leads to a stream (`/dev/stdout`, a FIFO), which
  is written through; a directory, block device or socket is never written as a file;
- an output directory that holds files dspec did not write is refused unless forced, and even
  then nothing in it is deleted (`check_output_dir`);
- two outputs on one path, or an output inside an input, are refused (`check_distinct`).

`write_atomic` replaces a regular (or new) file atomically, so a reader never sees a
half-written output; a new file gets the mode `open()` would give it (umask respected), a
replaced one keeps its mode. `directory_lock` lets one process at a time write a directory;
its `.lock` file is removed on exit, and one left by a killed process is stale (the kernel
lock died with it) and taken over.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import stat
import struct
import tempfile
from typing import Callable, Mapping

OUTPUT_KEY = 'dspec_output'     # top-level key of every JSON object dspec writes as output


class OutputPathError(OSError):
  """An output path names something that must not be written or replaced."""


def _kind(mode: int) -> str:
  if stat.S_ISREG(mode):
    return 'a file'
  if stat.S_ISDIR(mode):
    return 'a directory'
  if stat.S_ISBLK(mode):
    return 'a block device'
  if stat.S_ISSOCK(mode):
    return 'a socket'
  return 'a special file'


def _is_stream(mode: int) -> bool:
  """A character device or FIFO (/dev/null, /dev/stdout, a pipe): written through."""
  return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def _stat(path: str, follow: bool = True):
  try:
    return os.stat(path) if follow else os.lstat(path)
  except (FileNotFoundError, NotADirectoryError):
    return None


def _refuse_unwritable(path: str) -> bool:
  """OutputPathError unless `path` may be written as a file; True for a stream."""
  if not path:
    raise OutputPathError('empty output path')
  link = _stat(path, follow=False)
  if link is not None and stat.S_ISLNK(link.st_mode):
    target = _stat(path)
    if target is not None and _is_stream(target.st_mode):
      return True
    raise OutputPathError(f'{path}: is a symlink; dspec does not write through links '
                          '(give the path it points to)')
  if link is not None and _is_stream(link.st_mode):
    return True
  if link is not None and not stat.S_ISREG(link.st_mode):
    raise OutputPathError(f'{path}: is {_kind(link.st_mode)}, not a file; refusing to write it')
  return False


def _new_file_mode() -> int:
  """The mode `open(path, 'w')` gives a new file under the current umask (read from /proc
  where it can be, since setting it to read it is not thread-safe)."""
  try:
    with open('/proc/self/status') as f:
      umask = next(int(line.split()[1], 8) for line in f if line.startswith('Umask:'))
  except (OSError, StopIteration, ValueError, IndexError):
    umask = os.umask(0o022)
    os.umask(umask)
  return 0o666 & ~umask


def _write_through(path: str, write: Callable[[str], None]) -> None:
  """`write` into a private temporary file, then copy its bytes into the stream `path`."""
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

  A regular or new `path` is replaced atomically (rename of a sibling temporary file; a new
  file gets the umask's mode, a replaced one keeps its mode). A character device or FIFO,
  or a symlink to one, is written through. Any other symlink, a directory, block device or
  socket raises OutputPathError. Ownership (`check_output_file`) is the caller's check.
  """
  path = os.fspath(path)
  if _refuse_unwritable(path):
    _write_through(path, write)
    return
  st = _stat(path)
  tmp = f'{path}.tmp{os.getpid()}'
  try:
    write(tmp)
    if st is not None:
      shutil.copymode(path, tmp)
    else:
      os.chmod(tmp, _new_file_mode())
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


def read_json(path: str, what: str = 'JSON file'):
  """The JSON in `path`; ValueError naming the file when it is not readable JSON."""
  path = os.fspath(path)
  if os.path.isdir(path):
    raise ValueError(f'{path}: is a directory, not a {what}')
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f'{path}: not a valid {what} ({e})') from None


# ------------------------------------------------------------------------------ ownership

def mark(obj: dict, kind: str) -> dict:
  """`obj` with `OUTPUT_KEY: kind` first: what makes a JSON output recognisably dspec's."""
  return {OUTPUT_KEY: kind, **{k: v for k, v in obj.items() if k != OUTPUT_KEY}}


def _safetensors_metadata(path: str) -> dict:
  with open(path, 'rb') as f:
    head = f.read(8)
    if len(head) != 8:
      return {}
    (size,) = struct.unpack('<Q', head)
    if size > 100_000_000:
      return {}
    header = json.loads(f.read(size))
  return header.get('__metadata__') or {}


def written_by_dspec(path: str) -> bool:
  """Whether the regular file `path` is an output dspec wrote (its mark, see module doc)."""
  try:
    if path.endswith('.safetensors'):
      return OUTPUT_KEY in _safetensors_metadata(path)
    if os.path.getsize(path) > 2 ** 30:
      return False
    with open(path, encoding='utf-8') as f:
      obj = json.load(f)
  except (OSError, ValueError, UnicodeDecodeError, struct.error, AttributeError):
    return False
  return isinstance(obj, dict) and OUTPUT_KEY in obj


def check_output_file(path: str, flag: str, *, force: bool = False) -> None:
  """OutputPathError unless `path` may be written: new, a stream, a file dspec wrote, or
  (`force`) any regular file. `flag` names the argument in the message."""
  path = os.fspath(path)
  if not path:
    raise OutputPathError(f'{flag}: empty output path')
  try:
    if _refuse_unwritable(path):
      return
  except OutputPathError as e:
    raise OutputPathError(f'{flag}={e}') from None
  if os.path.exists(path) and not force and not written_by_dspec(path):
    raise OutputPathError(f'{flag}={path}: exists and was not written by dspec; refusing to '
                          'replace it (pass --force to replace it)')


def check_output_dir(path: str, flag: str, *, force: bool = False,
                     ours: Callable[[str], bool] = lambda d: False) -> None:
  """OutputPathError unless directory `path` may be written into: new, empty, one dspec
  wrote (`ours(path)`), or (`force`) any directory; nothing in it is ever deleted here."""
  path = os.fspath(path)
  if not path:
    raise OutputPathError(f'{flag}: empty output directory')
  link = _stat(path, follow=False)
  if link is None:
    return
  if stat.S_ISLNK(link.st_mode):
    raise OutputPathError(f'{flag}={path}: is a symlink; dspec does not write through links '
                          '(give the directory it points to)')
  if not stat.S_ISDIR(link.st_mode):
    raise OutputPathError(f'{flag}={path}: is {_kind(link.st_mode)}, not a directory')
  entries = [n for n in os.listdir(path) if n != LOCK_FILE]
  if entries and not force and not ours(path):
    raise OutputPathError(
        f'{flag}={path}: directory holds files dspec did not write ({sorted(entries)[0]!r}, '
        '...); use a new directory (or pass --force to write into it; nothing in it is '
        'deleted)')


def _real(path: str) -> str:
  return os.path.realpath(os.path.abspath(os.path.expanduser(os.fspath(path))))


def check_distinct(outputs: Mapping[str, str], inputs: Mapping[str, str] = {}) -> None:
  """OutputPathError when two outputs share a path, or an output is (inside) an input.

  outputs, inputs: {argument name: path}; empty paths are skipped."""
  seen = {}
  for flag, path in outputs.items():
    if not path:
      continue
    real = _real(path)
    if real in seen:
      raise OutputPathError(f'{seen[real]} and {flag} name the same file ({path}); give '
                            'each output its own path')
    seen[real] = flag
    for in_flag, in_path in inputs.items():
      if not in_path or '://' in str(in_path):
        continue
      source = _real(in_path)
      if real == source or real.startswith(source.rstrip(os.sep) + os.sep):
        raise OutputPathError(f'{flag}={path} is inside the input {in_flag}={in_path}; '
                              'refusing to write into an input (give another path)')


def check_outputs(outputs: Mapping[str, str], inputs: Mapping[str, str] = {}, *,
                  force: bool = False) -> None:
  """`check_distinct`, then `check_output_file` for every output given (None: not asked
  for): what a script runs before any work, so a bad output path costs nothing."""
  check_distinct(outputs, inputs)
  for flag, path in outputs.items():
    if path is not None:
      check_output_file(path, flag, force=force)


# ---------------------------------------------------------------------------------- locks

LOCK_FILE = '.lock'


class LockedError(OSError):
  """Another process holds the lock of a directory."""


_held_locks: dict[str, int] = {}


def _acquire(path: str, directory: str, what: str) -> int:
  """An fd of `path` holding its exclusive flock (retried if a releaser unlinked it)."""
  for _ in range(100):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, _new_file_mode())
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      holder = os.pread(fd, 64, 0).decode(errors='replace').strip() or '?'
      os.close(fd)
      if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        raise
      raise LockedError(f'{directory}: another {what} (pid {holder}) is using this directory; '
                        'wait for it to finish or use another directory') from None
    now = _stat(path)
    if now is not None and now.st_ino == os.fstat(fd).st_ino:
      return fd
    os.close(fd)   # the holder removed the file as we opened it: lock the new one
  raise LockedError(f'{directory}: cannot take {path}')


@contextlib.contextmanager
def directory_lock(directory: str, what: str):
  """Holds an exclusive lock on `directory` (its `.lock` file) for the `with` block.

  Another process asking for the same lock gets LockedError at once; the same process may
  nest it. The `.lock` file is removed on exit (and `directory` too when this call created
  it and nothing was written into it); after a kill -9 it stays behind, but its kernel lock
  died with the process, so the next run takes it over (stale, never blocking).
  """
  if os.path.exists(directory) and not os.path.isdir(directory):
    raise OutputPathError(f'{directory}: exists and is not a directory')
  created = not os.path.exists(directory)
  os.makedirs(directory, exist_ok=True)
  key = os.path.realpath(directory)
  if key in _held_locks:
    _held_locks[key] += 1
    try:
      yield
    finally:
      _held_locks[key] -= 1
    return
  path = os.path.join(directory, LOCK_FILE)
  fd = _acquire(path, directory, what)
  try:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f'{os.getpid()}\n'.encode(), 0)
    _held_locks[key] = 1
    try:
      yield
    finally:
      del _held_locks[key]
      with contextlib.suppress(FileNotFoundError):
        os.unlink(path)   # while still locked: a waiter re-checks the inode it locked
  finally:
    os.close(fd)
    if created:
      with contextlib.suppress(OSError):   # only an empty directory is removed
        os.rmdir(directory)
