"""The output-path policy: what dspec may write, replace or refuse, and how it writes.

One policy for every script and the API (docs/DESIGN.md, "Bad input"):

- a file dspec wrote (`written_by_dspec`: a JSON object carrying `OUTPUT_KEY`, or a
  safetensors file whose header or a PNG whose text chunks name it) may be replaced; any
  other existing file is refused unless the user forces it (`check_output_file`);
- a symlink is refused everywhere, unless it leads to a stream (`/dev/stdout`, a FIFO), which
  is written through; a directory, block device or socket is never written as a file;
- an output directory that holds files dspec did not write is refused unless forced, and even
  then nothing in it is deleted (`check_output_dir`);
- two outputs on one path, or an output inside (or equal to) an input, are refused
  (`check_distinct`; a config's inputs: `config_inputs`).

`check_outputs` applies all of it to a run's output flags before any work; every script's
output flags go through it. `write_atomic` replaces a regular (or new) file atomically, so a
reader never sees a half-written output; a new file gets the mode `open()` would give it
(umask respected), a replaced one keeps its mode. `write_dir` does the same for a directory.
A write that fails (disk full, read-only, permission denied) raises WriteError naming the
output, and leaves the previous output as it was. `directory_lock` lets one process at a
time write a directory; its `.lock` file is removed on exit, and one left by a killed
process is stale (the kernel lock died with it) and taken over.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import stat
import struct
import tempfile
import time
from typing import Callable, Mapping, Optional

from dspec.errors import DspecError

OUTPUT_KEY = 'dspec_output'     # top-level key of every JSON object dspec writes as output
# Config fields that name what a run reads (at any depth): no output may go inside them.
INPUT_FIELDS = frozenset({'path', 'tokenizer_dir', 'data_dir', 'token_map', 'init_from'})


class OutputPathError(DspecError, OSError):
  """An output path names something that must not be written or replaced."""


class WriteError(DspecError, OSError):
  """An output could not be written (disk full, read-only, permission denied)."""


def io_error_code(e: BaseException) -> Optional[int]:
  """The OS error number of an I/O failure: an OSError's, or the one a library names in its
  message (safetensors: `os error 28`, tensorstore: `os_error_code='28'`); else None."""
  if isinstance(e, OSError):
    return e.errno
  found = re.search(r"os[ _]error(?:_code=')? ?(\d+)", str(e))
  return int(found.group(1)) if found else None


@contextlib.contextmanager
def writing(path: str):
  """Turns an I/O failure in the block (`io_error_code`) into one WriteError naming the
  output `path` (not the temporary file it hit, nor a file written inside it); dspec's
  other errors pass through."""
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except  (libraries wrap OS errors)
    code = io_error_code(e)
    if code is None or (isinstance(e, DspecError) and not isinstance(e, WriteError)):
      raise
    error = WriteError(f'{path}: cannot write it ({os.strerror(code)}); nothing there was '
                       'replaced')
    error.errno = code
    raise error from None


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
    with writing(path):
      _write_through(path, write)
    return
  st = _stat(path)
  tmp = f'{path}.tmp{os.getpid()}'
  try:
    with writing(path):
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
  """Writes `text` to `path` atomically (creating the parent directory)."""
  with writing(path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

  def write(tmp):
    with open(tmp, 'w') as f:
      f.write(text)
  write_atomic(path, write)


def write_json_atomic(path: str, obj, indent: int = 1) -> None:
  """Writes `obj` as JSON to `path` atomically (creating the parent directory)."""
  with writing(path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

  def write(tmp):
    with open(tmp, 'w') as f:
      json.dump(obj, f, indent=indent)

  write_atomic(path, write)


def write_dir(path, write: Callable[[str], None], *, replace: bool = False) -> None:
  """`write(tmp)` makes a new directory `tmp` beside `path`, then its files go to `path`
  all at once; when `write` fails, `path` is as it was and `tmp` is removed.

  A new `path` is `tmp` renamed. An existing one is, with `replace` (the caller checked
  that it is a dspec output), replaced whole: renamed aside, `tmp` renamed in, the old one
  removed; without it each file of `tmp` replaces its namesake in `path` and nothing else
  there is touched. A symlink or a non-directory at `path` raises OutputPathError.
  """
  path = os.path.abspath(os.fspath(path))
  link = _stat(path, follow=False)
  if link is not None and not stat.S_ISDIR(link.st_mode):
    what = 'a symlink' if stat.S_ISLNK(link.st_mode) else _kind(link.st_mode)
    raise OutputPathError(f'{path}: is {what}, not a directory; refusing to write it')
  tag = f'{os.getpid()}-{time.time_ns()}'
  tmp, old = f'{path}.dspec-new-{tag}', f'{path}.dspec-old-{tag}'
  try:
    with writing(path):
      os.makedirs(os.path.dirname(path), exist_ok=True)
      write(tmp)
      if link is None:
        os.rename(tmp, path)
      elif replace:
        shutil.copymode(path, tmp)
        os.rename(path, old)
        try:
          os.rename(tmp, path)
        except BaseException:
          os.rename(old, path)
          raise
      else:
        for name in os.listdir(tmp):
          os.replace(os.path.join(tmp, name), os.path.join(path, name))
  finally:
    for leftover in (tmp, old):
      shutil.rmtree(leftover, ignore_errors=True)


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


def _png_text_keys(path: str) -> set:
  """The keywords of a PNG file's text chunks before its image data (matplotlib writes
  `savefig(metadata=...)` there)."""
  keys = set()
  with open(path, 'rb') as f:
    if f.read(8) != b'\x89PNG\r\n\x1a\n':
      return keys
    while len(head := f.read(8)) == 8:
      size, kind = struct.unpack('>I4s', head)
      if kind in (b'IDAT', b'IEND'):
        break
      data = f.read(size + 4)   # and its CRC
      if kind == b'tEXt':
        keys.add(data.split(b'\0', 1)[0].decode('latin-1'))
  return keys


def written_by_dspec(path: str) -> bool:
  """Whether the regular file `path` is an output dspec wrote (its mark, see module doc:
  a PNG carries it as a text chunk, `savefig(metadata={OUTPUT_KEY: kind})`)."""
  try:
    if path.endswith('.safetensors'):
      return OUTPUT_KEY in _safetensors_metadata(path)
    if path.endswith('.png'):
      return OUTPUT_KEY in _png_text_keys(path)
    if os.path.getsize(path) > 2 ** 30:
      return False
    with open(path, encoding='utf-8') as f:
      obj = json.load(f)
  except (OSError, ValueError, UnicodeDecodeError, struct.error, AttributeError):
    return False
  return isinstance(obj, dict) and OUTPUT_KEY in obj


def check_output_file(path: str, flag: str, *, force: bool = False,
                      ours: Callable[[str], bool] = written_by_dspec) -> None:
  """OutputPathError unless `path` may be written: new, a stream, a file dspec wrote
  (`ours(path)`), or (`force`) any regular file. `flag` names the argument in messages."""
  path = os.fspath(path)
  if not path:
    raise OutputPathError(f'{flag}: empty output path')
  try:
    if _refuse_unwritable(path):
      return
  except OutputPathError as e:
    raise OutputPathError(f'{flag}={e}') from None
  if os.path.exists(path) and not force and not ours(path):
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
                  force: bool = False, dirs: Mapping[str, Callable[[str], bool]] = {},
                  ours: Mapping[str, Callable[[str], bool]] = {}) -> None:
  """The output-path policy of one run, checked before any work so that a bad output path
  costs nothing: `check_distinct`, then every output given (None: not asked for) as a file
  (`check_output_file`) or, for a flag in `dirs`, a directory (`check_output_dir`, whose
  `ours` is `dirs[flag]`). `ours`: {flag: whether a file is an earlier output} for file
  outputs that carry no mark (`written_by_dspec`), such as Markdown tables.

  outputs, inputs: {argument name: path}; every script's output flags go through here."""
  check_distinct(outputs, inputs)
  for flag, path in outputs.items():
    if path is None:
      continue
    if flag in dirs:
      check_output_dir(path, flag, force=force, ours=dirs[flag])
    else:
      check_output_file(path, flag, force=force, ours=ours.get(flag, written_by_dspec))


def config_inputs(cfg, prefix: str = '--config.') -> dict:
  """{`--config.<field>`: path} of every non-empty field of a config, at any depth, whose
  name is in `INPUT_FIELDS`: what a run of it may read (the `inputs` of `check_outputs`)."""
  found = {}
  for key, value in cfg.items():
    if hasattr(value, 'items'):
      found.update(config_inputs(value, f'{prefix}{key}.'))
    elif key in INPUT_FIELDS and isinstance(value, (str, os.PathLike)) and value:
      found[f'{prefix}{key}'] = os.fspath(value)
  return found


def starts_with(prefix: str) -> Callable[[str], bool]:
  """Whether a text file begins with `prefix`: how an unmarked text output (a Markdown
  table whose first line a script writes) is recognised as an earlier one."""
  def check(path: str) -> bool:
    try:
      with open(path, encoding='utf-8') as f:
        return f.read(len(prefix)) == prefix
    except (OSError, UnicodeDecodeError):
      return False
  return check


# ---------------------------------------------------------------------------------- locks

LOCK_FILE = '.lock'


class LockedError(DspecError, OSError):
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
  with writing(directory):
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
