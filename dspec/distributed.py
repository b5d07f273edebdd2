"""Multi-process runs with JAX's own runtime: one process per host (or per accelerator), all
joined by `jax.distributed.initialize`, as a TPU pod slice or a multi-node GPU job runs.

Every process runs the same program over one global mesh (`sharding.make_mesh` takes
`jax.devices()`, every process's devices) and feeds only its own rows of each batch
(`global_batch`); values the host reads are replicated, so every process takes the same
decisions from them; only process 0 writes outputs and logs (`is_main`,
`quiet_unless_main`). On CPU the processes talk through the distributed CPU client with
gloo collectives.

Failures end in one line each, exit status 1, and never wait forever: a coordinator nobody
answers at (`timeout_s`), a coordinator port some other program holds, an address where
something else answers, processes that disagree on `num_processes` or never all join (a
watchdog ends the join at `timeout_s`, before the runtime would abort), and a peer that
dies (its collectives fail; `peer_failure`). docs/SCALE.md has the launch commands.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Optional

import jax
import numpy as np

from dspec.config_checks import check_float
from dspec.errors import UserError

DEFAULT_TIMEOUT_S = 120          # connecting: the coordinator, then every process joining
MAX_TIMEOUT_S = (2 ** 31 - 1) / 1000   # 2**31 - 1 ms (24 days): fits every runtime timeout
HEARTBEAT_TIMEOUT_S = 60         # a silent process is declared dead after this long
SHUTDOWN_TIMEOUT_S = 30          # the exit barrier waits this long for the others

_RUNTIME_FATAL = 'Terminating process because the JAX distributed service'
_PEER_FAILURE_MARKERS = ('Gloo', 'Connection closed by peer', 'Connection reset by peer',
                         'heartbeat timeout', 'coordination service', 'Socket closed')

# Runs beside the process while it joins: the runtime ends a failed join with a fatal log
# and a native stack (no Python exception); this prints it as one `error:` line instead.
_FATAL_FILTER = f'''
import sys
message, fatal, skipping = sys.argv[1], {_RUNTIME_FATAL!r}, False
for raw in sys.stdin.buffer:
  line = raw.decode(errors='replace')
  if fatal in line:
    status = line.split('absl::Status:', 1)[-1].strip()
    sys.stderr.write(f'error: {{message}} ({{status}})\\n')
    skipping = True
  elif not skipping:
    sys.stderr.write(line)
  sys.stderr.flush()
'''


def parse_coordinator(address: str) -> tuple:
  """'host:port' -> (host, port); ValueError naming --coordinator otherwise."""
  host, sep, port = address.rpartition(':')
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f'--coordinator must be host:port (port 1..65535), got {address!r}')
  return host.strip('[]'), int(port)


def check_arguments(coordinator: Optional[str], num_processes: Optional[int],
                    process_id: Optional[int],
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
  """ValueError naming the flag when the three are not given together or out of range, or
  when the timeout is not a finite number of seconds in (0, MAX_TIMEOUT_S]."""
  check_float(timeout_s, '--distributed_timeout', 0.0, MAX_TIMEOUT_S, low_open=True)
  given = {'--coordinator': coordinator, '--num_processes': num_processes,
           '--process_id': process_id}
  missing = [name for name, value in given.items() if value is None]
  if missing and len(missing) < 3:
    raise ValueError(f'{", ".join(n for n in given if n not in missing)} also needs '
                     f'{", ".join(missing)} (give all three, or none to read the cluster '
                     'environment)')
  if missing:
    return
  parse_coordinator(coordinator)
  if num_processes < 1:
    raise ValueError(f'--num_processes must be >= 1, got {num_processes}')
  if not 0 <= process_id < num_processes:
    raise ValueError(f'--process_id must be in [0, {num_processes - 1}] for '
                     f'--num_processes={num_processes}, got {process_id}')


def wait_for_coordinator(address: str, timeout_s: float) -> None:
  """Returns once `address` accepts TCP connections; UserError after `timeout_s`."""
  host, port = parse_coordinator(address)
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host, port), timeout=max(0.1, min(2.0, timeout_s))):
        return
    except OSError as e:
      if time.monotonic() >= deadline:
        raise UserError(f'cannot reach the coordinator at {address} within {timeout_s:g} s '
                        f'({e.strerror or e}); is process 0 running there, and is the '
                        'address right?') from None
      time.sleep(0.2)


def check_port_free(address: str) -> None:
  """UserError when process 0 could not serve on `address`'s port (another program holds
  it; the runtime would die in a native abort instead)."""
  _, port = parse_coordinator(address)
  with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as probe:
    try:
      probe.bind(('', port))
    except OSError as e:
      raise UserError(f'--coordinator={address}: port {port} is in use on this machine '
                      f'({e.strerror or e}); process 0 serves there: pick a free port') from None


@contextlib.contextmanager
def _deadline(seconds: float, message: str):
  """Ends the process (one `error:` line, status 1) if the block runs past `seconds`: a
  join can wait on a peer that never answers, or on a server that is not a coordinator."""
  finished = threading.Event()

  def watch():
    if not finished.wait(seconds):
      os.write(2, f'error: {message}\n'.encode())
      os._exit(1)

  threading.Thread(target=watch, daemon=True, name='dspec-join-deadline').start()
  try:
    yield
  finally:
    finished.set()


@contextlib.contextmanager
def _fatal_runtime_errors_as_one_line(message: str):
  """Native stderr goes through `_FATAL_FILTER` (a child process, so it outlives an abort)
  for the duration of the block."""
  try:
    sys.stderr.flush()
    saved = os.dup(2)
  except (OSError, ValueError):   # no real stderr (embedded): nothing to rewrite
    yield
    return
  filter_proc = subprocess.Popen([sys.executable, '-c', _FATAL_FILTER, message],
                                 stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                 stderr=saved)
  os.dup2(filter_proc.stdin.fileno(), 2)
  try:
    yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)
    filter_proc.stdin.close()
    filter_proc.wait(timeout=10)


def _agree_on_process_count(num_processes: int, timeout_s: float) -> None:
  """UserError on every process when they were started with different num_processes
  (the runtime itself only counts process 0's)."""
  from jax._src import distributed as jax_distributed   # the runtime's key-value store
  client = jax_distributed.global_state.client
  me = jax.process_index()
  client.key_value_set(f'dspec/num_processes/{me}', str(num_processes))
  for other in range(jax.process_count()):
    seen = client.blocking_key_value_get(f'dspec/num_processes/{other}',
                                         int(timeout_s * 1000))
    if int(seen) != num_processes:
      raise UserError(f'process {other} was started with --num_processes={seen}, process '
                      f'{me} with --num_processes={num_processes}; give every process the '
                      'same value')
  client.wait_at_barrier('dspec/num_processes', int(timeout_s * 1000))


def initialize(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
               heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S) -> None:
  """Joins this process to the others (before any other JAX use).

  With `coordinator` ('host:port' of process 0), `num_processes` and `process_id` given,
  those; with none of them, whatever `jax.distributed.initialize()` detects (Cloud TPU,
  SLURM, Open MPI, or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID). CPU
  devices use gloo collectives. Connecting is bounded by `timeout_s`; a failure is one
  `error:` line (UserError, or a runtime abort rewritten to one line).
  """
  check_arguments(coordinator, num_processes, process_id, timeout_s)
  if jax.distributed.is_initialized():
    raise UserError('jax.distributed is already initialized in this process')
  if jax.config.jax_cpu_collectives_implementation in (None, 'none'):
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  if coordinator is not None and process_id == 0:
    check_port_free(coordinator)
  if coordinator is not None and process_id != 0:
    wait_for_coordinator(coordinator, timeout_s)
  logging.getLogger('jax._src.distributed').setLevel(logging.WARNING)
  where = coordinator or 'the cluster environment'
  message = (f'not every process joined through the coordinator at {where} within '
             f'{timeout_s:g} s: is each one started, with the same --num_processes?')
  # The runtime's own timeout (a native abort) is set past the watchdog's.
  with _fatal_runtime_errors_as_one_line(message), _deadline(timeout_s, message):
    try:
      jax.distributed.initialize(coordinator, num_processes, process_id,
                                 initialization_timeout=min(int(max(1, timeout_s)) + 30,
                                                            int(MAX_TIMEOUT_S)),
                                 heartbeat_timeout_seconds=heartbeat_timeout_s,
                                 shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)
    except (RuntimeError, ValueError) as e:   # no cluster detected, bad environment
      raise UserError(f'cannot initialize jax.distributed from {where}: '
                      f'{str(e).strip().splitlines()[0]}') from None
  if num_processes is not None:
    with _deadline(timeout_s, message):
      _agree_on_process_count(num_processes, timeout_s)


def active() -> bool:
  """More than one process takes part in this run (jax.distributed joined them)."""
  return jax.distributed.is_initialized() and jax.process_count() > 1


def is_main() -> bool:
  """This is process 0: the one that writes outputs and logs."""
  return jax.process_index() == 0


def quiet_unless_main() -> None:
  """On processes other than 0: stdout, progress bars and library logs off (errors still
  reach stderr)."""
  if is_main():
    return
  sys.stdout = open(os.devnull, 'w')   # pylint: disable=consider-using-with
  os.environ['TQDM_DISABLE'] = '1'
  from absl import flags
  if 'quiet' in flags.FLAGS:   # the scripts' status lines (dspec.console)
    flags.FLAGS['quiet'].value = True
  from absl import logging as absl_logging
  absl_logging.set_verbosity(absl_logging.ERROR)


def local_rows(sharding, global_shape) -> slice:
  """The rows (leading axis) of an array of `global_shape` laid out by `sharding` that
  this process's devices hold: the rows it feeds."""
  starts, stops = [], []
  for index in sharding.addressable_devices_indices_map(tuple(global_shape)).values():
    rows = index[0] if index else slice(None)
    start, stop, _ = rows.indices(global_shape[0])
    starts.append(start)
    stops.append(stop)
  return slice(min(starts), max(stops))


def global_batch(batch: dict, placement) -> dict:
  """A batch (numpy leaves, the same global batch on every process) on `placement`'s mesh,
  each process contributing only the rows its devices hold."""
  specs = placement.batch_specs(batch)
  shardings = placement.shardings(specs)

  def one(x, sharding):
    x = np.asarray(x)
    if x.ndim == 0:
      return jax.make_array_from_process_local_data(sharding, x, x.shape)
    return jax.make_array_from_process_local_data(
        sharding, x[local_rows(sharding, x.shape)], x.shape)
  return jax.tree.map(one, batch, shardings)


def host_values(tree: Any) -> Any:
  """`jax.device_get(tree)`, where a leaf split over several processes is first gathered
  (every process must call this alike: it is a collective then)."""
  def one(x):
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
      from jax.experimental import multihost_utils
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.device_get(x)
  return jax.tree.map(one, tree)


def broadcast_json(value: Any) -> Any:
  """Process 0's JSON-serialisable `value`, on every process (single process: itself)."""
  if not active():
    return value
  from jax.experimental import multihost_utils
  data = np.frombuffer(json.dumps(value).encode(), np.uint8) if is_main() else \
      np.zeros(0, np.uint8)
  size = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))
  padded = np.zeros(size, np.uint8)
  padded[:data.size] = data[:size]
  return json.loads(bytes(multihost_utils.broadcast_one_to_all(padded)).decode())


def any_process(flags: tuple) -> tuple:
  """Each of `flags` (bools) or-ed over every process (a collective: all call it alike)."""
  if not active():
    return tuple(bool(f) for f in flags)
  from jax.experimental import multihost_utils
  every = multihost_utils.process_allgather(np.asarray(flags, np.bool_))
  return tuple(bool(f) for f in np.asarray(every).reshape(-1, len(flags)).any(axis=0))


def process_share():
  """`share(i)`: whether item i of a list split round-robin over the processes is this
  process's (every item, in a single-process run)."""
  count, index = jax.process_count(), jax.process_index()
  return lambda i: i % count == index


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier `name` (a no-op in one process)."""
  if active():
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def on_main(check) -> None:
  """Runs `check()` on process 0 only; the UserError, ValueError or OSError it raises is
  raised on every process (as UserError, with process 0's message), so all stop alike."""
  error = None
  if is_main():
    try:
      check()
    except (UserError, ValueError, OSError) as e:
      if not active():
        raise
      error = str(e)
  error = broadcast_json(error)
  if error is not None:
    raise UserError(error)


def peer_failure(error: BaseException) -> Optional[str]:
  """One line for an error that means another process died or hung up, else None."""
  if not active():
    return None
  text = str(error)
  if not any(marker in text for marker in _PEER_FAILURE_MARKERS):
    return None
  detail = next((line.strip() for line in text.splitlines() if line.strip()), '')
  if len(detail) > 160:
    detail = detail[:157] + '...'
  return (f'another process of this run failed or was stopped ({detail}); restart every '
          'process (training resumes from its last checkpoint)')


def exit_now(status: int) -> None:
  """Ends a multi-process run's process at once, skipping the runtime's exit barrier
  (which would wait for peers that may be gone)."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)   # pylint: disable=protected-access
