"""Entry-point plumbing: bad input ends in one clear line and a non-zero exit."""

from __future__ import annotations

import sys

from absl import app


class UserError(Exception):
  """An error caused by the command line, config or data the user gave."""


_USER_ERRORS = (UserError, ValueError, FileNotFoundError, KeyError)


def _user_error_types():
  try:
    from dspec.checkpoint import CheckpointError
    return _USER_ERRORS + (CheckpointError,)
  except ImportError:
    return _USER_ERRORS


def run(main):
  """`absl.app.run(main)`, printing `error: <message>` instead of a traceback."""

  def wrapped(argv):
    try:
      return main(argv)
    except _user_error_types() as e:
      message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      print(f'error: {message}', file=sys.stderr)
      sys.exit(1)

  app.run(wrapped)
