"""Entry-point plumbing: bad input ends in one clear line and a non-zero exit."""

from __future__ import annotations

import os
import signal
import sys

from absl import app, flags

from dspec import compiled_programs
from dspec.errors import DspecError, UserError

flags.DEFINE_string(
    'compilation_cache_dir', compiled_programs.DEFAULT_CACHE_DIR,
    'Persistent cache of compiled XLA programs, so a rerun does not recompile; "" turns it off.')
# Multi-process runs (dspec/distributed.py, docs/SCALE.md): all three, or none (a cluster's
# environment is read with --config.distributed=True).
flags.DEFINE_string('coordinator', None, 'host:port of process 0 (multi-process runs).')
flags.DEFINE_integer('num_processes', None, 'Processes in a multi-process run.')
flags.DEFINE_integer('process_id', None, 'This process in a multi-process run (0..N-1).')
flags.DEFINE_float('distributed_timeout', 120.0, 'Seconds to wait for the coordinator and '
                   'for every process to join (multi-process runs).')

_USER_ERRORS = (DspecError, ValueError, OSError, KeyError, OverflowError)
_OOM_MARKERS = ('RESOURCE_EXHAUSTED', 'Out of memory', 'out of memory')
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_default_config: list = []   # the default --config of the running script (define_config)


def define_config(default, help_string: str):
  """Defines the locked ml_collections `--config` flag. A `default` (a path relative to the
  repository) is applied at flag parsing, not at definition: so a bad `--config.<field>`
  override of the default config is one error line, from any working directory."""
  from ml_collections import config_flags
  if default:
    here = default if os.path.isfile(default.split(':', 1)[0]) else os.path.join(_REPO, default)
    _default_config.append(here)
  return config_flags.DEFINE_config_file('config', None, help_string, lock_config=True)


def _first_line(e: BaseException) -> str:
  """The message on one line; for config-file errors (which embed a traceback), its cause."""
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  if any(line.startswith('Traceback') for line in lines):
    return f'{lines[0]} {lines[-1]}' if not lines[0].startswith('Traceback') else lines[-1]
  return ' '.join(lines) or type(e).__name__


def _peer_failure(e: BaseException):
  """The one line for a multi-process run's error caused by another process, or None."""
  if 'jax' not in sys.modules:
    return None
  from dspec import distributed
  return distributed.peer_failure(e)


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


def _unknown_field(argv, error: BaseException) -> str:
  """The message for a `--config.<path>` override the config lacks: the first such path,
  with its near matches (the config file is loaded again without the overrides)."""
  from dspec.config_checks import unknown_field_message
  fallback = (f'unknown config field {str(error).strip(chr(34) + chr(39))!r} '
              '(check the --config.<field> names)')
  paths = [a[len('--config.'):].split('=', 1)[0] for a in argv[1:] if a.startswith('--config.')]
  files = [a[len('--config='):] for a in argv[1:] if a.startswith('--config=')]
  try:
    cfg = flags.FLAGS['config'].parser.parse(files[-1])
  except Exception:  # pylint: disable=broad-except  (no --config=, or it does not load)
    return fallback
  messages = (unknown_field_message(cfg, path) for path in paths)
  return next((m for m in messages if m), fallback)


def _config_attribute_error(e: AttributeError):
  """The missing field of an ml_collections ConfigDict lookup, or None for other errors."""
  tb = e.__traceback__
  while tb is not None and tb.tb_next is not None:
    tb = tb.tb_next
  if tb is None or 'ml_collections' not in tb.tb_frame.f_code.co_filename:
    return None
  return str(e).strip('"\'')


def _exit_with(message: str, status: int = 1):
  print(f'error: {message}', file=sys.stderr)
  if 'jax' in sys.modules:
    from dspec import distributed
    if distributed.active():   # not the exit barrier: the other processes may be gone
      distributed.exit_now(status)
  sys.exit(status)


def _join_processes():
  """jax.distributed.initialize from --coordinator/--num_processes/--process_id."""
  f = flags.FLAGS
  if f.coordinator is None and f.num_processes is None and f.process_id is None:
    return
  from dspec import distributed
  distributed.initialize(f.coordinator, f.num_processes, f.process_id,
                         timeout_s=f.distributed_timeout)
  distributed.quiet_unless_main()


def run(main):
  """`absl.app.run(main)`, printing `error: <message>` instead of a traceback.

  Mapped to one line and exit 1: bad flags or config files, every DspecError
  (`dspec.errors`: bad input, bad checkpoints, refused or failed outputs), ValueError,
  OSError, KeyError, OverflowError, a config lacking a field the script reads, and
  out-of-memory (XLA RESOURCE_EXHAUSTED or MemoryError, with a hint to shrink the batch).
  Ctrl-C unwinds the stack (locks released, temporary files removed) and exits 130 with
  one line. Anything else is a bug and keeps its traceback.
  """

  def wrapped(argv):
    try:
      _join_processes()
      if flags.FLAGS.compilation_cache_dir:
        compiled_programs.enable_persistent_cache(flags.FLAGS.compilation_cache_dir)
      return main(argv)
    except _USER_ERRORS as e:
      _exit_with(_peer_failure(e) or _first_line(e))
    except AttributeError as e:   # a config without a field the script reads
      missing = _config_attribute_error(e)
      if missing is None:
        raise
      _exit_with(f'the config has no field {missing!r} (is it a config for another script?)')
    except Exception as e:  # pylint: disable=broad-except
      if _out_of_memory(e):
        _exit_with(_oom_message(e))
      if _peer_failure(e):
        _exit_with(_peer_failure(e))
      raise
    except KeyboardInterrupt:
      _exit_with('interrupted', 128 + signal.SIGINT)

  def parse_flags(argv):
    if _default_config and not any(a == '--config' or a.startswith('--config=')
                                   for a in argv[1:]):
      argv = argv[:1] + [f'--config={_default_config[0]}'] + argv[1:]
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
      _exit_with(_unknown_field(argv, e))
    except (flags.Error, ValueError, TypeError, OSError, SyntaxError) as e:
      _exit_with(_first_line(e))

  app.run(wrapped, flags_parser=parse_flags)
