"""Run N processes of a dspec script on this machine, joined by jax.distributed.

  python scripts/launch_local.py -n 2 --devices_per_process 2 -- \
      scripts/decode.py --config=configs/demo.py --config.mesh=data=2,tensor=2

Each process gets `--coordinator=127.0.0.1:<free port> --num_processes=N --process_id=i`
(with --devices_per_process, JAX on CPU with that many simulated devices each). Their
stdout and stderr come through line by line with a `[p<i>] ` prefix. When one process fails,
the others are stopped (SIGTERM, then SIGKILL after --grace seconds) and the launcher exits
with its status; --timeout bounds the whole run (exit 124). Every process runs in its own
process group, which is killed on any exit of the launcher (including SIGINT, SIGTERM and
SIGHUP), and on Linux each also dies with the launcher itself (a parent-death signal), so
even a SIGKILLed launcher leaves nothing behind. A closed stdout or stderr (a reader that
went away) does not stall the processes: their output is then drained and dropped.
"""

import argparse
import atexit
import ctypes
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

_DEVICE_COUNT_FLAG = '--xla_force_host_platform_device_count'


_PR_SET_PDEATHSIG = 1


def _die_with_parent():
  """In the child before exec: SIGKILL when the launcher dies (Linux; elsewhere the
  process groups' cleanup on the launcher's exit is all there is)."""
  try:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  except (OSError, AttributeError):
    pass


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _say(message: str) -> None:
  """One line to stderr, unless nobody reads it any more."""
  try:
    print(message, file=sys.stderr, flush=True)
  except (OSError, ValueError):
    pass


def _fail(message: str, status: int = 2):
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(status)


def _parse(argv):
  parser = argparse.ArgumentParser(
      prog='launch_local.py', description=__doc__.split('\n\n')[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('-n', '--num_processes', type=int, required=True)
  parser.add_argument('--devices_per_process', type=int, default=0,
                      help='simulated CPU devices per process (0: leave JAX as configured)')
  parser.add_argument('--timeout', type=float, default=600.0,
                      help='seconds before every process is stopped (exit 124)')
  parser.add_argument('--grace', type=float, default=5.0,
                      help='seconds between SIGTERM and SIGKILL when stopping')
  parser.add_argument('--port', type=int, default=0, help='coordinator port (0: a free one)')
  parser.add_argument('command', nargs=argparse.REMAINDER,
                      help='-- script.py [its flags]')
  parser.error = _fail
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ['--'] else args.command
  if not command:
    _fail('give the script to run after --, e.g. -- scripts/decode.py --config=...')
  if not command[0].endswith('.py') or not os.path.isfile(command[0]):
    _fail(f'{command[0]!r} is not a Python script')
  if args.num_processes < 1:
    _fail(f'-n must be >= 1, got {args.num_processes}')
  if args.devices_per_process < 0:
    _fail(f'--devices_per_process must be >= 0, got {args.devices_per_process}')
  if not (math.isfinite(args.timeout) and args.timeout > 0):   # NaN or inf: no bound
    _fail(f'--timeout must be a finite number of seconds > 0, got {args.timeout}')
  if not (math.isfinite(args.grace) and args.grace >= 0):
    _fail(f'--grace must be a finite number of seconds >= 0, got {args.grace}')
  return args, command


def _environment(devices: int) -> dict:
  env = dict(os.environ, PYTHONUNBUFFERED='1')
  if devices:
    flags = [f for f in env.get('XLA_FLAGS', '').split() if not f.startswith(_DEVICE_COUNT_FLAG)]
    env['XLA_FLAGS'] = ' '.join(flags + [f'{_DEVICE_COUNT_FLAG}={devices}'])
    env['JAX_PLATFORMS'] = 'cpu'
  return env


class Processes:
  """The launched processes: started, forwarded, stopped (always, whole groups)."""

  def __init__(self):
    self.procs = []
    self._threads = []
    self._lock = threading.Lock()

  def start(self, argv, env, prefix):
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=_die_with_parent if sys.platform == 'linux' else None)
    self.procs.append(proc)
    for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
      thread = threading.Thread(target=self._forward, args=(stream, out, prefix),
                                daemon=True)
      thread.start()
      self._threads.append(thread)

  def _forward(self, stream, out, prefix):
    """Copies `stream` to `out` line by line; once `out` fails (closed), drains `stream`
    (a child blocked on a full pipe would hang until the timeout)."""
    writable = True
    for raw in iter(stream.readline, b''):
      if not writable:
        continue
      with self._lock:
        try:
          out.write(prefix + raw.decode(errors='replace'))
          out.flush()
        except (OSError, ValueError):   # a broken pipe; a closed file
          writable = False
    stream.close()

  def signal_all(self, sig):
    for proc in self.procs:
      if proc.poll() is None:
        try:
          os.killpg(proc.pid, sig)
        except ProcessLookupError:
          pass

  def stop(self, grace: float):
    """SIGTERM to every live group, SIGKILL after `grace` s; then the groups' leftovers."""
    self.signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
      time.sleep(0.05)
    for proc in self.procs:
      try:
        os.killpg(proc.pid, signal.SIGKILL)   # also children a dead leader left behind
      except (ProcessLookupError, PermissionError):
        pass
      proc.wait()
    for thread in self._threads:
      thread.join(timeout=2)


def _describe(status: int) -> str:
  if status < 0:
    return f'was killed by {signal.Signals(-status).name}'
  return f'exited with status {status}'


def main(argv) -> int:
  args, command = _parse(argv)
  port = args.port or free_port()
  procs = Processes()
  atexit.register(procs.stop, 0.0)

  def on_signal(signum, frame):
    del frame
    _say(f'launch_local: {signal.Signals(signum).name} received; stopping every process')
    procs.stop(args.grace)
    os._exit(128 + signum)

  for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, on_signal)
  env = _environment(args.devices_per_process)
  for i in range(args.num_processes):
    procs.start([sys.executable, '-u', *command, f'--coordinator=127.0.0.1:{port}',
                 f'--num_processes={args.num_processes}', f'--process_id={i}'],
                env, f'[p{i}] ')
  deadline = time.monotonic() + args.timeout
  while True:
    statuses = [p.poll() for p in procs.procs]
    failed = [(i, s) for i, s in enumerate(statuses) if s not in (None, 0)]
    if failed:
      i, status = failed[0]
      if any(s is None for s in statuses):
        _say(f'launch_local: process {i} {_describe(status)}; stopping the others')
      procs.stop(args.grace)
      return status if status > 0 else 128 - status
    if all(s == 0 for s in statuses):
      procs.stop(0.0)
      return 0
    if time.monotonic() > deadline:
      _say(f'launch_local: timed out after {args.timeout:g} s; stopping every process')
      procs.stop(args.grace)
      return 124
    time.sleep(0.05)


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
