"""Multi-process runs on JAX's own runtime (jax.distributed on 127.0.0.1, gloo collectives):
2 processes x 2 simulated CPU devices decode the demo on a data=2,tensor=2 mesh with the
same tokens as one process (every drafter family; greedy and sampled, fixed and auto
verification, every process taking the controller's decisions alike), and each failure
mode ends in one line, in time.

Greedy runs of every drafter are compared with one process's AR run on the same mesh (a
lossless greedy drafter commits AR's tokens, so this is the single-process output), sampled
runs with one process's run of the same drafter and seed: one process compiles 3 runs, not 8.

Every run goes through `scripts/launch_local.py`, which bounds it in time and kills whole
process groups, so a failing test leaves no process behind.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

from xla_flags import cpu_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DECODE = os.path.join(REPO, 'tests', 'scale', 'multiprocess_decode.py')
LAUNCH = os.path.join(REPO, 'scripts', 'launch_local.py')
# Every drafter family, auto verification (controller decisions broadcast), sampled runs,
# token trees (tree, auto_tree).
# Compiling dominates: one run per drafter (MTP under auto and auto_tree, n-gram under tree;
# the DFlash backbone greedy with DFlash-2's selector and sampled with DSpark's heads), the
# controller on two tiers (AR and num_draft), suffix on verify widths 1, 2 and 4.
RUNS = ('mtp:auto:0,eagle3:fixed:1,dflash2:fixed:0,dspark:fixed:1,suffix:fixed:0,'
        'ngram:tree:0,mtp:auto_tree:0')
AR = 'none:fixed:0'
SINGLE_RUNS = ','.join([AR] + [r for r in RUNS.split(',') if not r.endswith(':0')])
# The demo target itself (`small`, not the widened main job): compiling stays what dominates.
COMMON = ['--config=configs/demo.py:small', '--config.max_new_tokens=12',
          '--config.controller.tiers=(0,)', '--config.drafters.suffix.num_draft=4',
          '--config.tree.num_nodes=8', '--config.tree.top_k=2',
          '--compilation_cache_dir=']


def _run(argv, timeout, env=None):
  return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                        env=env, stdin=subprocess.DEVNULL)


@pytest.fixture(scope='module')
def single_and_multi(tmp_path_factory):
  """One process on 4 devices and 2 processes x 2 devices, side by side."""
  tmp = tmp_path_factory.mktemp('mp')
  one, two = str(tmp / 'one.json'), str(tmp / 'two.json')
  mesh = '--config.mesh=data=2,tensor=2'
  single = subprocess.Popen([sys.executable, DECODE, *COMMON, f'--runs={SINGLE_RUNS}', mesh,
                             f'--out={one}'],
                            cwd=REPO, env=cpu_env(4), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
  multi = _run([sys.executable, LAUNCH, '-n', '2', '--devices_per_process', '2',
                '--timeout', '500', '--', DECODE, *COMMON, f'--runs={RUNS}', mesh,
                f'--out={two}'], 520,
               cpu_env(2))
  out, err = single.communicate(timeout=520)
  assert single.returncode == 0, err[-3000:]
  assert multi.returncode == 0, multi.stderr[-3000:]
  with open(one) as f1, open(two) as f2:
    return json.load(f1), json.load(f2), multi


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_decode_as_one(single_and_multi):
  one, two, _ = single_and_multi
  assert one['processes'] == 1 and two['processes'] == 2
  assert sum(map(len, one['runs'][AR]['ids'])) > 0
  for run in RUNS.split(','):
    same = AR if run.endswith(':0') else run   # greedy: AR's tokens; sampled: the same run's
    assert two['runs'][run]['ids'] == one['runs'][same]['ids'], run


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_process_takes_the_same_decisions(single_and_multi):
  _, two, _ = single_and_multi
  for run in RUNS.split(','):
    digests = two['runs'][run]['trace_digests']
    assert len(digests) == 2 and digests[0] == digests[1], run
  for run in ('mtp:auto:0', 'mtp:auto_tree:0'):   # the controller ran and recorded tiers
    assert two['runs'][run]['tier_steps'], run


@pytest.mark.multiprocess
@pytest.mark.slow
def test_only_process_0_prints(single_and_multi):
  _, _, multi = single_and_multi
  lines = [l for l in multi.stdout.splitlines() if 'tau=' in l]
  assert lines and all(l.startswith('[p0] ') for l in lines), multi.stdout[-2000:]


def test_bad_flags_and_an_unusable_coordinator_are_one_line_each():
  """The quick check's part of the failure modes, in this process: the checks a process
  runs on its flags and its coordinator before it joins (each one line, naming the flag)."""
  from dspec import distributed   # pylint: disable=import-outside-toplevel
  sys.path.insert(0, os.path.join(REPO, 'scripts'))
  from launch_local import free_port   # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match='host:port'):
    distributed.check_arguments('127.0.0.1', 2, 0)
  with pytest.raises(ValueError, match='also needs --process_id'):
    distributed.check_arguments(f'127.0.0.1:{free_port()}', 2, None)
  with pytest.raises(ValueError, match=r'--process_id must be in \[0, 1\]'):
    distributed.check_arguments(f'127.0.0.1:{free_port()}', 2, 2)
  nobody = f'127.0.0.1:{free_port()}'
  with pytest.raises(ValueError, match='cannot reach the coordinator') as e:
    distributed.wait_for_coordinator(nobody, timeout_s=0.3)
  assert '\n' not in str(e.value)
  with socket.socket() as other_server:
    other_server.bind(('127.0.0.1', 0))
    other_server.listen()
    with pytest.raises(ValueError, match='is in use') as e:
      distributed.check_port_free(f'127.0.0.1:{other_server.getsockname()[1]}')
  assert '\n' not in str(e.value)


def _error_lines(stderr):
  return [l for l in stderr.splitlines() if 'error:' in l]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_failure_modes_are_one_line_each():
  sys.path.insert(0, os.path.join(REPO, 'scripts'))
  from launch_local import free_port   # pylint: disable=import-outside-toplevel
  port = free_port()
  common = [DECODE, '--config=configs/demo.py:small', '--out=/dev/null',
            '--compilation_cache_dir=', '--distributed_timeout=4']
  # Process 1 of 2 with nobody at the coordinator's address.
  proc = _run([sys.executable, *common, f'--coordinator=127.0.0.1:{port}',
               '--num_processes=2', '--process_id=1'], 60, cpu_env(1))
  assert proc.returncode != 0
  assert _error_lines(proc.stderr) and 'cannot reach the coordinator' in proc.stderr
  assert 'Traceback' not in proc.stderr
  # Two processes that disagree on --num_processes.
  port = free_port()
  argv = lambda n, i: [sys.executable, *common, f'--coordinator=127.0.0.1:{port}',
                       f'--num_processes={n}', f'--process_id={i}']
  procs = [subprocess.Popen(argv(2, 0), cwd=REPO, env=cpu_env(1), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL),
           subprocess.Popen(argv(3, 1), cwd=REPO, env=cpu_env(1), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)]
  try:
    outs = [p.communicate(timeout=90) for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, (_, err) in zip(procs, outs):
    assert p.returncode != 0
    assert len(_error_lines(err)) == 1, err[-2000:]
    assert 'Traceback' not in err
  # Process 0 alone: the others never join; the watchdog ends it with status 1 (the
  # runtime's own timeout was a native abort, SIGABRT).
  port = free_port()
  proc = _run([sys.executable, *common, f'--coordinator=127.0.0.1:{port}',
               '--num_processes=2', '--process_id=0'], 90, cpu_env(1))
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert len(_error_lines(proc.stderr)) == 1 and 'not every process joined' in proc.stderr
  # Process 0's port held by another program; process 1 at an address where something
  # that is not a coordinator answers: each one line, status 1, within the timeout.
  with socket.socket() as other_server:
    other_server.bind(('127.0.0.1', 0))
    other_server.listen()
    held = f'--coordinator=127.0.0.1:{other_server.getsockname()[1]}'
    for process_id, expected in (('0', 'is in use'), ('1', 'not every process joined')):
      proc = _run([sys.executable, *common, held, '--num_processes=2',
                   f'--process_id={process_id}'], 90, cpu_env(1))
      assert proc.returncode == 1, proc.stderr[-2000:]
      errors = _error_lines(proc.stderr)
      assert len(errors) == 1 and expected in errors[0], proc.stderr[-2000:]
  # Bad flags: one line before anything starts.
  proc = _run([sys.executable, *common, '--coordinator=127.0.0.1', '--num_processes=2',
               '--process_id=0'], 60, cpu_env(1))
  assert proc.returncode != 0 and 'host:port' in proc.stderr
  proc = _run([sys.executable, *common, f'--coordinator=127.0.0.1:{port}',
               '--num_processes=2'], 60, cpu_env(1))
  assert proc.returncode != 0 and '--process_id' in proc.stderr


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_dead_peer_ends_the_run_in_one_line(tmp_path):
  """Process 1 is killed (-9) once the first of three runs is done, while both decode the
  second; process 0 ends with one error line, well before the runtime's heartbeat
  timeout."""
  import signal
  import time
  sys.path.insert(0, os.path.join(REPO, 'scripts'))
  from launch_local import free_port   # pylint: disable=import-outside-toplevel
  port = free_port()
  argv = lambda i: [sys.executable, '-u', DECODE, '--config=configs/demo.py:small',
                    '--out=/dev/null', '--compilation_cache_dir=',
                    '--config.max_new_tokens=400',
                    '--runs=ngram:fixed:0,ngram:fixed:1,ngram:fixed:0',
                    '--config.mesh=data=2', f'--coordinator=127.0.0.1:{port}',
                    '--num_processes=2', f'--process_id={i}']
  logs = [open(tmp_path / f'p{i}.err', 'w+') for i in range(2)]   # pipes would fill up
  procs = [subprocess.Popen(argv(i), cwd=REPO, env=cpu_env(1), stdout=subprocess.PIPE,
                            stderr=logs[i], text=True, stdin=subprocess.DEVNULL,
                            start_new_session=True) for i in range(2)]
  try:
    for line in procs[0].stdout:   # the first run is done: both are in the second
      if line.startswith('ngram:fixed:0:'):
        break
    os.killpg(procs[1].pid, signal.SIGKILL)
    start = time.monotonic()
    procs[0].communicate(timeout=120)
    took = time.monotonic() - start
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
      p.wait()
    for log in logs:
      log.close()
  err = (tmp_path / 'p0.err').read_text()
  assert procs[0].returncode != 0
  assert len(_error_lines(err)) == 1 and 'another process' in err, err[-3000:]
  assert 'Traceback' not in err
  assert took < 90
