"""Data-parallel drafter training across processes (jax.distributed on 127.0.0.1, gloo):
2 processes x 1 CPU device train a tiny DFlash drafter with the losses of 1 process x 2
devices on the same global batches; one process killed (-9) mid-run ends the other in one
line, and both restarted resume from the shared checkpoint with the same losses. Two
processes distil the same files as one."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from xla_flags import cpu_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(REPO, 'tests', 'scale', 'train_with_step_delay.py')
LAUNCH = os.path.join(REPO, 'scripts', 'launch_local.py')
STEPS, CKPT_EVERY = 12, 4


def _losses(workdir):
  with open(os.path.join(workdir, 'train_log.jsonl')) as f:
    return {e['step']: e['loss'] for e in map(json.loads, f)}


@pytest.fixture(scope='module')
def data(tmp_path_factory):
  """16 rows of 32 random tokens (the first 4 unsupervised), as distill.py writes them."""
  root = tmp_path_factory.mktemp('mptrain')
  tokens = np.random.default_rng(0).integers(2, 256, (16, 32)).astype(np.int32)
  np.savez(root / 'shard_00000.npz', tokens=tokens,
           loss_mask=np.broadcast_to(np.arange(32) >= 4, tokens.shape),
           lengths=np.full(16, 32, np.int32))
  (root / 'manifest.json').write_text(json.dumps({'shards': ['shard_00000.npz'],
                                                  'complete': True}))
  return root


def _args(data, workdir):
  return ['--config=configs/dflash_demo.py:tiny', f'--config.data.path={data}',
          '--config.data.heldout_fraction=0.0', f'--config.training.num_steps={STEPS}',
          '--config.training.batch_size=4', '--config.training.seq_len=32',
          '--config.training.log_every=1', f'--config.training.ckpt_every={CKPT_EVERY}',
          '--config.training.eval_every=100', f'--workdir={workdir}',
          '--compilation_cache_dir=']


@pytest.fixture(scope='module')
def single_and_multi(data, tmp_path_factory):
  """1 process x 2 devices (mesh data=2) beside 2 processes x 1 device (the default mesh:
  data over every process's device)."""
  tmp = tmp_path_factory.mktemp('runs')
  single = subprocess.Popen(
      [sys.executable, TRAIN, *_args(data, tmp / 'one'), '--config.training.mesh=data=2'],
      cwd=REPO, env=cpu_env(2, PYTHONUNBUFFERED='1'), stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
  multi = subprocess.run([sys.executable, LAUNCH, '-n', '2', '--devices_per_process', '1',
                          '--timeout', '240', '--', TRAIN, *_args(data, tmp / 'two')],
                         cwd=REPO, capture_output=True, text=True, timeout=260,
                         stdin=subprocess.DEVNULL)
  _, err = single.communicate(timeout=260)
  assert single.returncode == 0, err[-3000:]
  assert multi.returncode == 0, multi.stderr[-3000:]
  return tmp / 'one', tmp / 'two', multi


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_train_as_one(single_and_multi):
  one, two, _ = single_and_multi
  losses_one, losses_two = _losses(one), _losses(two)
  assert sorted(losses_two) == list(range(1, STEPS + 1))
  np.testing.assert_allclose([losses_two[s] for s in losses_one],
                             list(losses_one.values()), rtol=1e-5)
  assert len(set(losses_one.values())) > 1   # it trained: the loss moved
  assert os.path.isdir(two / 'final') and sorted(map(int, os.listdir(two / 'checkpoints'))) == \
      [STEPS - CKPT_EVERY, STEPS]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_only_process_0_logs(single_and_multi):
  _, _, multi = single_and_multi
  steps = [l for l in multi.stdout.splitlines() if '"loss"' in l]
  assert len(steps) == STEPS and all(l.startswith('[p0] ') for l in steps)


def test_a_dead_peer_is_one_line_saying_to_restart(monkeypatch):
  """The quick check's part of the killed-process test, in this process: the one line a
  process ends with when a collective fails because its peer died."""
  from dspec import distributed   # pylint: disable=import-outside-toplevel
  error = RuntimeError('Gloo allreduce failed: Connection closed by peer [127.0.0.1]:4321\n'
                       '  (native stack follows)')
  assert distributed.peer_failure(error) is None   # one process has no peers
  monkeypatch.setattr(distributed, 'active', lambda: True)
  line = distributed.peer_failure(error)
  assert line.startswith('another process of this run failed or was stopped') and '\n' not in line
  assert 'Connection closed by peer' in line and 'resumes from its last checkpoint' in line
  assert distributed.peer_failure(ValueError('shapes (4,) and (8,) differ')) is None


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_killed_process_resumes_from_the_shared_checkpoint(data, single_and_multi,
                                                             tmp_path):
  """Process 1 is killed -9 after step CKPT_EVERY + 2; process 0 stops with one error
  line; both restarted continue from the last checkpoint with the uninterrupted losses."""
  sys.path.insert(0, os.path.join(REPO, 'scripts'))
  from launch_local import free_port   # pylint: disable=import-outside-toplevel
  _, reference, _ = single_and_multi
  workdir, port = tmp_path / 'run', free_port()
  argv = lambda i, delay: [sys.executable, TRAIN, f'--step_delay={delay}',
                           *_args(data, workdir), f'--coordinator=127.0.0.1:{port}',
                           '--num_processes=2', f'--process_id={i}']
  errs = [open(tmp_path / f'p{i}.err', 'w+') for i in range(2)]   # pipes could fill up
  procs = [subprocess.Popen(argv(i, 0.5), cwd=REPO, env=cpu_env(1, PYTHONUNBUFFERED='1'),
                            stdout=subprocess.DEVNULL, stderr=errs[i], stdin=subprocess.DEVNULL,
                            start_new_session=True) for i in range(2)]
  try:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and procs[0].poll() is None:
      if os.path.exists(workdir / 'train_log.jsonl') and \
          max(_losses(workdir), default=0) >= CKPT_EVERY + 2:
        break
      time.sleep(0.05)
    os.killpg(procs[1].pid, signal.SIGKILL)
    procs[0].wait(timeout=120)
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
      p.wait()
    for f in errs:
      f.close()
  err = (tmp_path / 'p0.err').read_text()
  assert procs[0].returncode != 0
  errors = [l for l in err.splitlines() if 'error:' in l]
  assert len(errors) == 1 and 'another process' in errors[0], err[-3000:]
  done_before = max(_losses(workdir))
  assert CKPT_EVERY + 2 <= done_before < STEPS
  resumed = subprocess.run([sys.executable, LAUNCH, '-n', '2', '--devices_per_process', '1',
                            '--timeout', '240', '--', TRAIN, *_args(data, workdir)],
                           cwd=REPO, capture_output=True, text=True, timeout=260,
                           stdin=subprocess.DEVNULL)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert 'resumed from step' in resumed.stderr or 'resum' in resumed.stdout
  losses, want = _losses(workdir), _losses(reference)
  assert sorted(losses) == list(range(1, STEPS + 1))
  np.testing.assert_allclose([losses[s] for s in want], list(want.values()), rtol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_distill_as_one(tmp_path):
  """Each of 2 processes writes its round-robin share of the shards; process 0's manifest
  then lists them all: files byte-identical to one process's."""
  argv = [os.path.join(REPO, 'scripts', 'distill.py'), '--config=configs/distill_demo.py:tiny',
          '--compilation_cache_dir=']
  single = subprocess.Popen([sys.executable, *argv, f'--out_dir={tmp_path / "one"}'], cwd=REPO,
                            env=cpu_env(1, PYTHONUNBUFFERED='1'), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
  multi = subprocess.run([sys.executable, LAUNCH, '-n', '2', '--devices_per_process', '1',
                          '--timeout', '240', '--', *argv, f'--out_dir={tmp_path / "two"}'],
                         cwd=REPO, capture_output=True, text=True, timeout=260,
                         stdin=subprocess.DEVNULL)
  _, err = single.communicate(timeout=260)
  assert single.returncode == 0, err[-3000:]
  assert multi.returncode == 0, multi.stderr[-3000:]
  names = sorted(os.listdir(tmp_path / 'one'))
  assert len([n for n in names if n.startswith('shard_')]) >= 2
  assert sorted(os.listdir(tmp_path / 'two')) == names
  for name in names:
    assert (tmp_path / 'one' / name).read_bytes() == (tmp_path / 'two' / name).read_bytes(), name
