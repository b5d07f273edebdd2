"""Entry-point plumbing: bad input ends in one clear line and a non-zero exit."""

from __future__ import annotations

import os
import sys

from absl import app, flags

from dspec import compiled_programs
from dspec.errors import UserError

flags.DEFINE_string(
    'compilation_cache_dir', compiled_programs.DEFAULT_CACHE_DIR,
    'Persistent cache of compiled XLA programs, so a rerun does not recompile; "" turns it off.')

_USER_ERRORS = (UserError, ValueError, OSError, KeyError, OverflowError)
_OOM_MARKERS = ('RESOURCE_EXHAUSTED', 'Out of memory', 'out of memory')


def _user_error_types():
  try:
    from dspec.checkpoint import CheckpointError
    return _USER_ERRORS + (CheckpointError,)
  except ImportError:
    return _USER_ERRORS


def _first_line(e: BaseException) -> str:
  """The message on one line; for config-file errors (which embed a traceback), its cause."""
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  if any(line.startswith('Traceback') for line in lines):
    return f'{lines[0]} {lines[-1]}' if not lines[0].startswith('Traceback') else lines[-1]
  return ' '.join(lines) or type(e).__name__


def _out_of_memory(e: BaseException) -> bool:
  """A device (XLA RESOURCE_EXHAUSTED) or host out-of-memory failure."""
  return isinstance(e, MemoryError) or any(m in str(e) for m in _OOM_MARKERS)


def _oom_message(e: BaseException) -> str:
  detail = next((line.strip() for line in str(e).splitlines()
                 if any(m in line for m in _OOM_MARKERS)), type(e).__name__)
  if len(detail) > 200:
    detail = detail[:197] + '...'
  return (f'out of memory ({detail}); try a smaller batch_size or max_new_tokens '
          '(training: a smaller training.batch_size or seq_len)')


def _renamed_config_field(path: str):
  """The one-line message for a config field that was renamed or removed, or None."""
  from dspec.config_checks import legacy_field_message
  return legacy_field_message(path)


def _exit_with(message: str):
  print(f'error: {message}', file=sys.stderr)
  sys.exit(1)


def run(main):
  """`absl.app.run(main)`, printing `error: <message>` instead of a traceback.

  Mapped to one line and exit 1: bad flags or config files, UserError, ValueError, OSError,
  KeyError, OverflowError, CheckpointError, and out-of-memory (XLA RESOURCE_EXHAUSTED or
  MemoryError, with a hint to shrink the batch). Anything else is a bug and keeps its
  traceback.
  """

  def wrapped(argv):
    try:
      if flags.FLAGS.compilation_cache_dir:
        compiled_programs.enable_persistent_cache(flags.FLAGS.compilation_cache_dir)
      return main(argv)
    except _user_error_types() as e:
      _exit_with(_first_line(e))
    except Exception as e:  # pylint: disable=broad-except
      if _out_of_memory(e):
        _exit_with(_oom_message(e))
      raise

  def parse_flags(argv):
    for arg in argv[1:]:
      if arg.startswith('--config=') and not os.path.isfile(arg[9:].split(':', 1)[0]):
        _exit_with(f'config file not found: {arg[9:].split(":", 1)[0]}')
      if arg.startswith('--config.'):
        renamed = _renamed_config_field(arg[len('--config.'):].split('=', 1)[0])
        if renamed:
          _exit_with(renamed)
    try:
      return flags.FLAGS(argv)
    except (AttributeError, KeyError) as e:   # ml_collections: `--config.<unknown>=...`
      _exit_with(f'unknown config key {str(e).strip(chr(34) + chr(39))!r} '
                 f'(check the --config.<field> names)')
    except (flags.Error, ValueError, TypeError, OSError, SyntaxError) as e:
      _exit_with(_first_line(e))

  app.run(wrapped, flags_parser=parse_flags)
