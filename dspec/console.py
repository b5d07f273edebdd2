"""What the command-line tools print besides their results: one status line per phase (on
stderr), progress bars, and library logs kept quiet unless asked for.

Importing this module defines the `--quiet` flag (no status lines, no progress bars).
"""

from __future__ import annotations

import logging
import os
import sys
import time

from absl import flags
from absl import logging as absl_logging

_NOISY_LOGGERS = ('absl', 'orbax', 'jax', 'etils')
QUIET = flags.DEFINE_bool('quiet', False, 'No status lines and no progress bars.')


def configure() -> 'Status':
  """Silences library INFO logs (orbax, absl, jax) unless `--verbosity` >= 1 was given;
  with `--quiet` also every tqdm bar (TQDM_DISABLE). Returns the status printer."""
  verbosity = flags.FLAGS['verbosity'] if 'verbosity' in flags.FLAGS else None
  if verbosity is None or not verbosity.present or verbosity.value < 1:
    absl_logging.set_verbosity(absl_logging.WARNING)
    for name in _NOISY_LOGGERS:
      logging.getLogger(name).setLevel(logging.WARNING)
  if QUIET.value:
    os.environ['TQDM_DISABLE'] = '1'
  return Status(QUIET.value)


class Status:
  """Prints `[dspec  12.3s] <phase>` lines on stderr (nothing when quiet)."""

  def __init__(self, quiet: bool = False):
    self.quiet = quiet
    self._start = time.perf_counter()

  def __call__(self, message: str) -> None:
    if not self.quiet:
      print(f'[dspec {time.perf_counter() - self._start:6.1f}s] {message}', file=sys.stderr,
            flush=True)
