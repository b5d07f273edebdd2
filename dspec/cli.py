"""Entry-point plumbing: bad input ends in one clear line and a non-zero exit."""

from __future__ import annotations

import os
import sys

from absl import app, flags


class UserError(Exception):
  """An error caused by the command line, config or data the user gave."""


_USER_ERRORS = (UserError, ValueError, OSError, KeyError)


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


def _exit_with(message: str):
  print(f'error: {message}', file=sys.stderr)
  sys.exit(1)


def run(main):
  """`absl.app.run(main)`, printing `error: <message>` instead of a traceback."""

  def wrapped(argv):
    try:
      return main(argv)
    except _user_error_types() as e:
      _exit_with(_first_line(e))

  def parse_flags(argv):
    for arg in argv[1:]:
      if arg.startswith('--config=') and not os.path.isfile(arg[9:].split(':', 1)[0]):
        _exit_with(f'config file not found: {arg[9:].split(":", 1)[0]}')
    try:
      return flags.FLAGS(argv)
    except (AttributeError, KeyError) as e:   # ml_collections: `--config.<unknown>=...`
      _exit_with(f'unknown config key {str(e).strip(chr(34) + chr(39))!r} '
                 f'(check the --config.<field> names)')
    except (flags.Error, ValueError, TypeError, OSError) as e:
      _exit_with(_first_line(e))

  app.run(wrapped, flags_parser=parse_flags)
