"""Issues 15 and 39: corrupted checkpoints are detected, user files are never deleted or
clobbered, bad input gets one `error:` line (CLI) or a ValueError naming the argument (API),
and NaN never passes silently.

Sections follow the issues: data loss, silently wrong, tracebacks; then issue 39's classes:
the output-path policy, API argument validation, config errors, errors naming their file,
locks and manifests; then knob ranges and stored numbers (controller, tree and multi-process
knobs, drafter settings a tree ignores, numbers in a model's files). The full red-team sweep
is `python scripts/redteam.py`, not a test.
"""

import dataclasses
import glob
import json
import math
import os
import re
import stat
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from configs import common
from conftest import REPO_ROOT, TINY
from dspec import checkpoint, cli, config_checks, files
from dspec.checkpoint import CheckpointError
from dspec.hf_import import read_hf_config
from dspec.models.formats.hf_config import config_from_hf
from dspec.models.transformer import Transformer
from dspec.tokenizer import load_tokenizer
from dspec.training import trainer


def _run_script(script, *args, timeout=300):
  proc = subprocess.run([sys.executable, os.path.join(REPO_ROOT, 'scripts', script), *args],
                        cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
  return proc.returncode, proc.stdout, proc.stderr


def _one_error_line(rc, stderr, expected):
  assert rc == 1, stderr[-2000:]
  assert 'Traceback' not in stderr, stderr[-2000:]
  errors = [line for line in stderr.splitlines() if line.startswith('error: ')]
  assert len(errors) == 1 and expected in errors[0], stderr[-2000:]


@pytest.fixture(scope='module')
def tiny_target():
  return Transformer(TINY, rngs=nnx.Rngs(0))


def _save_target(path, model, **kw):
  checkpoint.save_model(path, model, kind='target', config=TINY.to_dict(), **kw)


def _load_target(path):
  abstract = nnx.eval_shape(lambda: Transformer(TINY, rngs=nnx.Rngs(1)))
  checkpoint.load_model_state(path, abstract, 'target')
  return abstract


def _flip_byte(path, fraction=0.5):
  data = bytearray(open(path, 'rb').read())
  data[int(len(data) * fraction)] ^= 0x10
  with open(path, 'wb') as f:
    f.write(bytes(data))


def _largest_data_file(ckpt_dir):
  found = [f for f in glob.glob(os.path.join(ckpt_dir, 'state', '**', 'd', '*'),
                                recursive=True) if os.path.isfile(f)]
  return max(found, key=os.path.getsize)


# --------------------------------------------------------------------------- a toy trainer
# A 32x32 linear regression: compiles in well under a second, and its arrays are big enough
# to land in orbax data files (so byte flips hit array data).

class _Toy(nnx.Module):

  def __init__(self):
    self.w = nnx.Param(jax.random.normal(jax.random.key(0), (32, 32)) * 0.1)


def _toy_task(poison_step=None, exports=None):
  """poison_step: the 1-based step whose loss is NaN."""

  def loss_fn(model, frozen, batch, key):
    del frozen, key
    err = batch['x'] @ model.w[...] - batch['x']
    return jnp.mean(err ** 2) * batch['scale'], {}

  def get_batch(step):
    x = np.random.default_rng(step).normal(size=(8, 32)).astype(np.float32)
    return {'x': x, 'scale': np.float32(np.nan if step + 1 == poison_step else 1.0)}

  def export(model, path, step):
    checkpoint.save_model(path, model, kind='toy', config={}, extra={'train_step': step},
                          force=True)
    if exports is not None:
      exports.append(step)

  return trainer.TrainTask(model=_Toy(), frozen=None, loss_fn=loss_fn, get_batch=get_batch,
                           export=export)


def _toy_cfg(num_steps=4, **kw):
  cfg = common.training_config('toy')
  cfg.update(dict(dict(num_steps=num_steps, learning_rate=1e-2, warmup_ratio=0.0,
                       log_every=1, eval_every=1000, ckpt_every=2), **kw))
  return cfg


def _logged_steps(workdir):
  with open(os.path.join(workdir, 'train_log.jsonl')) as f:
    return [json.loads(line)['step'] for line in f]


def _steps(workdir):
  return sorted(int(n) for n in os.listdir(os.path.join(workdir, 'checkpoints'))
                if n.isdigit())


# ================================================================================ data loss

@pytest.mark.parametrize('where', ['', '.', '/', '~'])
def test_force_refuses_empty_and_root_like_paths(where, tiny_target):
  with pytest.raises(CheckpointError, match='empty|refusing'):
    _save_target(os.path.expanduser(where) if where == '~' else where, tiny_target,
                 force=True)


def test_force_refuses_a_directory_that_is_not_a_checkpoint(tmp_path, tiny_target):
  mine = tmp_path / 'mine'
  mine.mkdir()
  (mine / 'thesis.tex').write_text('years of work')
  with pytest.raises(CheckpointError, match='not a dspec checkpoint'):
    _save_target(mine, tiny_target, force=True)
  assert (mine / 'thesis.tex').read_text() == 'years of work'
  # A checkpoint directory with a user's file inside is not replaced either.
  ckpt = tmp_path / 'ckpt'
  _save_target(ckpt, tiny_target)
  (ckpt / 'notes.txt').write_text('keep me')
  with pytest.raises(CheckpointError, match="'notes.txt'"):
    _save_target(ckpt, tiny_target, force=True)
  assert (ckpt / 'notes.txt').read_text() == 'keep me'
  plain = tmp_path / 'file.bin'
  plain.write_bytes(b'data')
  with pytest.raises(CheckpointError, match='not a checkpoint directory'):
    _save_target(plain, tiny_target, force=True)
  assert plain.read_bytes() == b'data'


def test_force_replaces_a_checkpoint_directory_only_once_the_new_one_is_complete(
    tmp_path, tiny_target):
  ckpt = tmp_path / 'ckpt'
  _save_target(ckpt, tiny_target, extra={'v': 1})
  (ckpt / 'tokenizer.json').write_text('{}')  # exports copy tokenizer files beside weights
  _save_target(ckpt, tiny_target, extra={'v': 2}, force=True)
  assert checkpoint.read_model_metadata(ckpt, 'target')['extra'] == {'v': 2}
  assert sorted(os.listdir(tmp_path)) == ['ckpt']  # no leftovers beside it


@pytest.mark.multiprocess
@pytest.mark.slow
def test_convert_hf_force_with_an_empty_out_deletes_nothing(tmp_path, tiny_target):
  from dspec.hf_export import export_to_hf
  hf_dir = tmp_path / 'hf'
  export_to_hf(tiny_target, hf_dir)
  sentinel = tmp_path / 'work' / 'keep.txt'
  sentinel.parent.mkdir()
  sentinel.write_text('x')
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO_ROOT, 'scripts', 'convert_hf.py'),
       f'--hf_dir={hf_dir}', '--out=', '--force'],
      cwd=sentinel.parent, capture_output=True, text=True, timeout=300)
  _one_error_line(proc.returncode, proc.stderr, 'empty')
  assert sentinel.read_text() == 'x'


def test_output_symlink_is_refused_unless_it_leads_to_a_stream(tmp_path):
  target = tmp_path / 'real.json'
  target.write_text('old')
  link = tmp_path / 'link.json'
  link.symlink_to(target)
  with pytest.raises(files.OutputPathError, match='symlink'):
    files.write_json_atomic(str(link), {'a': 1})
  assert link.is_symlink() and target.read_text() == 'old'
  fifo = tmp_path / 'fifo'
  os.mkfifo(fifo)
  (tmp_path / 'to_fifo').symlink_to(fifo)
  reader = subprocess.Popen(['cat', str(fifo)], stdout=subprocess.PIPE, text=True)
  files.write_json_atomic(str(tmp_path / 'to_fifo'), {'a': 1})
  assert json.loads(reader.communicate(timeout=30)[0]) == {'a': 1}


def test_output_character_device_is_written_through_not_replaced(tmp_path):
  node = tmp_path / 'null'
  try:
    os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))   # like /dev/null
  except PermissionError:
    pytest.skip('mknod needs root')
  files.write_json_atomic(str(node), {'a': 1})
  assert stat.S_ISCHR(os.stat(node).st_mode)
  assert sorted(os.listdir(tmp_path)) == ['null']


def test_output_directory_is_refused_and_regular_files_keep_their_mode(tmp_path):
  with pytest.raises(files.OutputPathError, match='directory'):
    files.write_json_atomic(str(tmp_path), {'a': 1})
  regular = tmp_path / 'm.json'
  regular.write_text('{}')
  os.chmod(regular, 0o600)
  files.write_json_atomic(str(regular), {'a': 1})
  assert stat.S_IMODE(os.stat(regular).st_mode) == 0o600
  assert json.loads(regular.read_text()) == {'a': 1}


# =========================================================================== silently wrong

def test_corrupted_model_checkpoint_is_refused_naming_the_array(tmp_path, tiny_target):
  path = tmp_path / 'ckpt'
  _save_target(path, tiny_target)
  _flip_byte(_largest_data_file(path))
  with pytest.raises(CheckpointError, match=r"array '[\w.]+' does not match its checksum"):
    _load_target(path)


def test_checkpoint_without_checksums_still_loads_as_unverified(tmp_path, tiny_target,
                                                                caplog):
  """Exports written before checksums existed (no `array_sha256`) keep loading."""
  path = tmp_path / 'old'
  params = nnx.to_pure_dict(nnx.state(tiny_target, nnx.Param))
  metadata = dict(kind='target', config=TINY.to_dict(), storage_dtype='float32',
                  extra={'train_step': 7}, dspec_format_version=1)
  checkpoint._checkpointer().save(path, args=ocp.args.Composite(
      state=ocp.args.PyTreeSave(params), metadata=ocp.args.JsonSave(metadata)))
  loaded = _load_target(path)
  np.testing.assert_array_equal(loaded.lm_head[...], tiny_target.lm_head[...])
  assert 'not verified' in caplog.text
  assert checkpoint.read_train_step(path) == 7


def test_exporting_non_finite_weights_is_an_error(tmp_path):
  model = _Toy()
  model.w[...] = model.w[...].at[3, 4].set(jnp.nan)
  with pytest.raises(CheckpointError, match="non-finite weights.*'w'"):
    checkpoint.save_model(tmp_path / 'nan', model, kind='toy', config={})
  assert not (tmp_path / 'nan').exists()


@pytest.mark.slow
def test_corrupted_training_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, capsys):
  workdir = str(tmp_path / 'run')
  trainer.train(_toy_task(), _toy_cfg(4), workdir)
  assert _steps(workdir) == [2, 4]
  _flip_byte(_largest_data_file(os.path.join(workdir, 'checkpoints', '4')))
  exports = []
  result = trainer.train(_toy_task(exports=exports), _toy_cfg(6), workdir)
  err = capsys.readouterr().err
  assert 'checkpoints/4' in err and 'resuming from the older intact checkpoint at step 2' in err
  assert result['steps'] == 4 and exports == [6]
  assert os.path.isdir(os.path.join(workdir, 'checkpoints', 'corrupt_4'))  # kept, not deleted
  assert _steps(workdir) == [4, 6]
  assert _logged_steps(workdir) == [1, 2, 3, 4, 5, 6]  # 3 and 4 re-run, logged once


def test_no_intact_checkpoint_is_an_error_and_renames_nothing(tmp_path):
  workdir = str(tmp_path / 'run')
  trainer.train(_toy_task(), _toy_cfg(2), workdir)
  _flip_byte(_largest_data_file(os.path.join(workdir, 'checkpoints', '2')))
  with pytest.raises(CheckpointError, match='no intact checkpoint'):
    trainer.train(_toy_task(), _toy_cfg(4), workdir)
  assert _steps(workdir) == [2]


@pytest.mark.slow
def test_old_training_checkpoints_and_exports_without_checksums_resume(tmp_path):
  """State written by the code before checksums (same layout, no `array_sha256`)."""
  workdir = str(tmp_path / 'run')
  task = _toy_task()
  cfg = _toy_cfg(4)
  from dspec.training import optimizer as optimizer_lib
  params = nnx.state(task.model, nnx.Param)
  opt_state = optimizer_lib.make_optimizer(cfg).init(params)
  manager = ocp.CheckpointManager(os.path.join(workdir, 'checkpoints'),
                                  item_handlers=checkpoint._item_handlers())
  manager.save(2, args=ocp.args.Composite(
      state=ocp.args.PyTreeSave({'params': params, 'opt_state': opt_state}),
      metadata=ocp.args.JsonSave({'step': 2})))
  manager.wait_until_finished()
  manager.close()
  assert trainer.train(task, cfg, workdir)['steps'] == 2

  export = str(tmp_path / 'export')   # warm restart from an old-style export at step 3
  checkpoint._checkpointer().save(export, args=ocp.args.Composite(
      state=ocp.args.PyTreeSave(nnx.to_pure_dict(params)),
      metadata=ocp.args.JsonSave({'kind': 'toy', 'extra': {'train_step': 3}})))
  result = trainer.train(_toy_task(), _toy_cfg(5, init_from=export, continue_from_init=True),
                         str(tmp_path / 'warm'))
  assert result['steps'] == 2


@pytest.mark.parametrize('log_every, poison, named', [(1, 3, 3), (10, 3, 3)])
def test_non_finite_loss_stops_training_naming_the_step(tmp_path, capfd, log_every, poison,
                                                        named):
  workdir = str(tmp_path / 'run')
  exports = []
  try:
    trainer.train(_toy_task(poison_step=poison, exports=exports),
                  _toy_cfg(6, log_every=log_every), workdir)
  except trainer.TrainingDiverged as e:   # read while the raising frames are alive
    error, err = str(e), capfd.readouterr().err
  assert re.search(f'non-finite loss .* at step {named}', error)
  # the progress bar is closed first, so the CLI's error line starts a line of its own
  assert err.endswith('\n'), err[-200:]
  assert _steps(workdir) == [2] and exports == []   # step 4 was not checkpointed
  assert not os.path.exists(os.path.join(workdir, 'final'))
  if log_every == 1:
    assert _logged_steps(workdir) == [1, 2]


@pytest.mark.parametrize('field, value', [
    ('learning_rate', math.nan), ('learning_rate', math.inf), ('learning_rate', -1.0),
    ('ckpt_every', 0), ('log_every', 0), ('eval_every', -5), ('num_steps', 0),
    ('seed', 2 ** 31), ('b2', 1.0), ('grad_clip', math.nan), ('export_every', -1),
    ('storage_dtype', 'float16'), ('mixture', {'gsm8k': 0.0}),
    ('mixture', {'gsm8k': math.nan}),
])
def test_bad_training_numbers_are_refused_naming_the_field(field, value):
  cfg = _toy_cfg()
  if field == 'mixture':
    cfg.unlock()
    del cfg['mixture']
  cfg[field] = value
  with pytest.raises(cli.UserError, match=f'training.{field}'):
    config_checks.check_training_config(cfg)


@pytest.mark.parametrize('field, value, message', [
    ('temperature', math.nan, 'temperature must be a finite'),
    ('temperature', -0.5, 'temperature'),
    ('top_p', math.nan, 'top_p'),
    ('top_p', 0.0, 'top_p'),
    ('top_k', -1, 'top_k'),
    ('seed', 2 ** 31, r'seed must be in \[0, 2147483647\]'),
    ('max_new_tokens', 3_000_000_000, 'max_new_tokens'),
    ('max_new_tokens', 0, 'max_new_tokens'),
    ('batch_size', 0, 'batch_size'),
    ('prompt_index', -1, 'prompt_index'),
])
def test_bad_sampling_knobs_and_sizes_are_refused(field, value, message):
  cfg = common.decode_config('tiny')
  config_checks.check_decode_config(cfg)
  cfg[field] = value
  with pytest.raises(cli.UserError, match=message):
    config_checks.check_decode_config(cfg)


def test_prompts_are_never_silently_mishandled():
  with pytest.raises(cli.UserError, match='out of range.*has 3 prompts'):
    config_checks.check_prompt_index(999999, 3, 'gsm8k_test')
  with pytest.raises(cli.UserError, match=r'prompt_index must be in \[0'):
    config_checks.check_prompt_index(-1, 3, 'gsm8k_test')
  assert config_checks.check_prompt_index(2, 3, 'gsm8k_test') == 2
  with pytest.raises(cli.UserError, match='3 prompts given but batch_size=2'):
    config_checks.check_prompts(['a', 'b', 'c'], 2)
  config_checks.check_prompts(['a'], 4)   # fewer prompts fill the batch (documented)


@pytest.mark.slow
def test_distillation_refuses_a_resume_with_another_target(tmp_path):
  from configs import distill_demo
  from dspec.training import distill
  cfg = distill_demo.get_config('tiny')
  cfg.data_dir = os.path.join(REPO_ROOT, 'data')
  cfg.distill.prompt_sets = {'gsm8k_train': 4}
  out = str(tmp_path / 'd')
  manifest = distill.distill(cfg, out)
  assert manifest['complete'] and len(manifest['target_sha256']) == 64
  cfg.model.seed = 1   # same path and settings, other weights
  with pytest.raises(ValueError, match='other target weights'):
    distill.distill(cfg, out)
  with open(os.path.join(out, 'manifest.json')) as f:
    assert json.load(f)['shards'] == manifest['shards']


@pytest.mark.slow
def test_sigterm_stops_training_at_a_step_checkpointed_and_exported(tmp_path, capsys):
  """A preempted or killed run (SIGTERM) ends its step, saves it and exports it, then a
  rerun resumes from that step."""
  workdir = str(tmp_path / 'run')
  exports = []
  task = _toy_task(exports=exports)
  get_batch = task.get_batch

  def get_batch_then_terminate(step):
    if step == 2:
      os.kill(os.getpid(), signal.SIGTERM)
    return get_batch(step)

  task.get_batch = get_batch_then_terminate
  result = trainer.train(task, _toy_cfg(8, ckpt_every=100), workdir)
  assert 'stopping at step 3: SIGTERM received' in capsys.readouterr().out
  assert result['steps'] == 3 and _steps(workdir) == [3]
  assert exports == [3, 3]                                  # export/ and final/
  assert checkpoint.read_train_step(os.path.join(workdir, 'export')) == 3
  assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL   # the handler is put back
  assert trainer.train(_toy_task(), _toy_cfg(8, ckpt_every=100), workdir)['steps'] == 5


@pytest.mark.slow
def test_resume_trims_the_train_log_to_the_restored_step(tmp_path):
  workdir = str(tmp_path / 'run')
  trainer.train(_toy_task(), _toy_cfg(4), workdir)
  with open(os.path.join(workdir, 'train_log.jsonl'), 'a') as f:   # killed after step 6
    f.write('{"step": 5, "loss": 1.0}\n{"step": 6, "loss": 1.0}\n{"step": 7, "lo')
  trainer.train(_toy_task(), _toy_cfg(6), workdir)
  assert _logged_steps(workdir) == [1, 2, 3, 4, 5, 6]


def test_resume_with_nothing_to_train_keeps_final(tmp_path, capsys):
  workdir = str(tmp_path / 'run')
  trainer.train(_toy_task(), _toy_cfg(4), workdir)
  final_meta = os.path.join(workdir, 'final', 'metadata', 'metadata')
  before = open(final_meta).read()
  exports = []   # rerunning a finished run is a no-op (sweeps and job scripts rerun)
  assert trainer.train(_toy_task(exports=exports), _toy_cfg(4), workdir)['steps'] == 0
  assert exports == [] and 'nothing to train' in capsys.readouterr().out
  with pytest.raises(cli.UserError, match='past training.num_steps=2: nothing to train'):
    trainer.train(_toy_task(), _toy_cfg(2), workdir)
  assert open(final_meta).read() == before
  # A run killed between its last checkpoint and the final export gets final/ written.
  os.rename(os.path.join(workdir, 'final'), os.path.join(workdir, 'final_old'))
  exports = []
  assert trainer.train(_toy_task(exports=exports), _toy_cfg(4), workdir)['steps'] == 0
  assert exports == [4]


@pytest.mark.multiprocess
def test_a_second_trainer_on_a_workdir_is_refused(tmp_path):
  workdir = str(tmp_path / 'run')
  holder = subprocess.Popen(
      [sys.executable, '-c', textwrap.dedent(f'''
          import sys, time
          sys.path.insert(0, {REPO_ROOT!r})
          from dspec.files import directory_lock
          with directory_lock({workdir!r}, 'trainer'):
            print('locked', flush=True)
            time.sleep(60)''')], stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == 'locked'
    with pytest.raises(files.LockedError, match=f'another trainer \\(pid {holder.pid}\\)'):
      trainer.train(_toy_task(), _toy_cfg(2), workdir)
    assert not os.path.exists(os.path.join(workdir, 'checkpoints'))
  finally:
    holder.kill()
    holder.wait()
  assert trainer.train(_toy_task(), _toy_cfg(2), workdir)['steps'] == 2  # lock died with it


# =============================================================================== tracebacks

@pytest.mark.multiprocess
@pytest.mark.slow
def test_train_and_distill_without_config_are_one_error_line():
  for script in ('train.py', 'distill.py'):
    rc, _, stderr = _run_script(script, '--out_dir=/tmp/unused' if script == 'distill.py'
                                else '--workdir=/tmp/unused')
    _one_error_line(rc, stderr, 'config')


@pytest.mark.multiprocess
@pytest.mark.slow
def test_zero_every_is_one_error_line():
  rc, _, stderr = _run_script('train.py', '--config=configs/demo_target_v2.py:quick',
                              '--config.training.ckpt_every=0', '--workdir=/tmp/unused_run')
  _one_error_line(rc, stderr, 'training.ckpt_every must be in [1,')


@pytest.mark.multiprocess
def test_data_of_another_vocabulary_is_one_error_line(tmp_path):
  """A drafter trained on data distilled with another tokenizer: the 256-token tiny
  target on the demo's 8,192-token data would embed ids past its table (NaN losses, and an
  error blaming the learning rate); it is refused when the data loads, naming both."""
  rc, _, stderr = _run_script('train.py', '--config=configs/dflash_demo.py:tiny',
                              f'--workdir={tmp_path / "run"}')
  _one_error_line(rc, stderr, "outside the target's vocabulary of 256")
  assert not os.path.exists(tmp_path / 'run' / 'checkpoints')


@pytest.mark.parametrize('content, message', [
    ('[]', 'must hold a JSON object'),
    (None, "vocab_size must be a positive integer, got 'abc'"),
    ({'num_attention_heads': 0}, 'num_attention_heads must be a positive integer, got 0'),
    ({'num_key_value_heads': 0}, 'num_key_value_heads must be a positive integer, got 0'),
    ({'rope_scaling': 'x'}, 'rope_scaling must be an object'),
    ({'rope_theta': 'big'}, 'rope_theta must be a positive finite number'),
    ({'rope_parameters': {'rope_type': 'default', 'rope_theta': 1e4},
      'rope_scaling': {'rope_type': 'yarn', 'factor': 4.0}}, "'yarn' is not supported"),
])
def test_bad_hf_config_json_is_a_clear_error(tmp_path, content, message):
  config = {'model_type': 'llama', 'vocab_size': 32, 'hidden_size': 16,
            'intermediate_size': 32, 'num_hidden_layers': 1, 'num_attention_heads': 2}
  if content is None:
    config['vocab_size'] = 'abc'
  elif isinstance(content, dict):
    config.update(content)
  (tmp_path / 'config.json').write_text(content if isinstance(content, str)
                                        else json.dumps(config))
  with pytest.raises(ValueError, match=message):
    config_from_hf(read_hf_config(tmp_path))


@pytest.mark.multiprocess
def test_convert_hf_with_a_bad_config_is_one_error_line(tmp_path):
  (tmp_path / 'hf').mkdir()
  (tmp_path / 'hf' / 'config.json').write_text('[]')
  rc, _, stderr = _run_script('convert_hf.py', f'--hf_dir={tmp_path / "hf"}',
                              f'--out={tmp_path / "out"}')
  _one_error_line(rc, stderr, 'must hold a JSON object')
  assert not (tmp_path / 'out').exists()


def test_corrupt_tokenizer_files_are_named(tmp_path):
  (tmp_path / 'tokenizer.json').write_text('{"version": "1.0", "model": {trunc')
  with pytest.raises(ValueError, match='tokenizer.json: not a valid tokenizer.json'):
    load_tokenizer(str(tmp_path), 300)
  os.remove(tmp_path / 'tokenizer.json')
  (tmp_path / 'config.json').write_text('{"eos_token_id": "abc"}')
  with pytest.raises(ValueError, match='config.json: eos_token_id must be a non-negative'):
    load_tokenizer(str(tmp_path), 300)
  (tmp_path / 'tokenizer_config.json').write_text('{oops')
  with pytest.raises(ValueError, match='tokenizer_config.json: not valid JSON'):
    load_tokenizer(str(tmp_path), 300)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize('raised, expected', [
    ("RuntimeError('RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.3GiB')",
     'out of memory (RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.3GiB); '
     'try a smaller batch_size or max_new_tokens'),
    ("OverflowError('Python int too large to convert to C int')",
     'Python int too large to convert to C int'),
])
def test_cli_wrapper_maps_oom_and_overflow_to_one_line(raised, expected):
  code = textwrap.dedent(f'''
      import sys
      sys.path.insert(0, {REPO_ROOT!r})
      from dspec import cli
      def main(argv):
        raise {raised}
      cli.run(main)''')
  proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                        timeout=60)
  _one_error_line(proc.returncode, proc.stderr, expected)


# ==================================================== issue 39: the output-path policy
# A dspec-written file may be replaced; anything else only with --force; symlinks refused
# the same way everywhere; no two outputs on one path, none inside an input; a directory
# dspec did not write is never emptied; new files get the umask's mode.

def test_a_file_dspec_did_not_write_is_refused_unless_forced(tmp_path):
  theirs = tmp_path / 'm.json'
  theirs.write_text('{"mine": true}')
  with pytest.raises(files.OutputPathError, match='not written by dspec.*--force'):
    files.check_output_file(str(theirs), '--metrics_json')
  files.check_output_file(str(theirs), '--metrics_json', force=True)
  ours = tmp_path / 'ours.json'
  files.write_json_atomic(str(ours), files.mark({'tau': 1.0}, 'decode metrics'))
  files.check_output_file(str(ours), '--metrics_json')          # an earlier run's: replaced
  files.check_output_file(str(tmp_path / 'new.json'), '--metrics_json')
  (tmp_path / 'link.json').symlink_to(ours)
  for force in (False, True):
    with pytest.raises(files.OutputPathError, match='--metrics_json=.*symlink'):
      files.check_output_file(str(tmp_path / 'link.json'), '--metrics_json', force=force)
  with pytest.raises(files.OutputPathError, match='directory'):
    files.check_output_file(str(tmp_path), '--metrics_json', force=True)


def test_two_outputs_on_one_path_or_an_output_inside_an_input_are_refused(tmp_path):
  with pytest.raises(files.OutputPathError, match='--metrics_json and --trace_json name the '
                     'same file'):
    files.check_distinct({'--metrics_json': 'a.json', '--trace_json': './a.json'})
  ckpt = tmp_path / 'ckpt'
  ckpt.mkdir()
  with pytest.raises(files.OutputPathError, match='inside the input --path'):
    files.check_distinct({'--out': str(ckpt / 'export')}, {'--path': str(ckpt)})
  files.check_distinct({'--out': str(tmp_path / 'export')}, {'--path': str(ckpt)})


@pytest.mark.multiprocess
@pytest.mark.slow
def test_decode_refuses_bad_outputs_before_loading_anything(tmp_path):
  (tmp_path / 'theirs.json').write_text('years of work')
  for args, message in [
      ((f'--metrics_json={tmp_path}/a.json', f'--trace_json={tmp_path}/a.json'),
       'name the same file'),
      ((f'--metrics_json={tmp_path}/theirs.json',), 'not written by dspec'),
      (('--metrics_json=demo/target/m.json',), 'inside the input --config.model.path')]:
    rc, _, stderr = _run_script('decode.py', '--config=configs/tiny.py',
                                '--config.model.source=random', '--config.model.path=demo/target',
                                *args, timeout=120)
    _one_error_line(rc, stderr, message)
  assert (tmp_path / 'theirs.json').read_text() == 'years of work'
  assert not os.path.exists(os.path.join(REPO_ROOT, 'demo', 'target', 'm.json'))


@pytest.mark.multiprocess
def test_a_directory_dspec_did_not_write_is_never_emptied(tmp_path):
  from dspec.bench import report
  theirs = tmp_path / 'theirs'
  theirs.mkdir()
  (theirs / report.RESULTS).write_text('[{"mine": true}]')
  rc, _, stderr = _run_script('benchmark.py', '--config=configs/bench_tiny.py',
                              f'--out_dir={theirs}', timeout=120)
  _one_error_line(rc, stderr, 'holds files dspec did not write')
  assert (theirs / report.RESULTS).read_text() == '[{"mine": true}]'
  report.remove_stale(str(theirs))   # also with --force: nothing of theirs is deleted
  assert (theirs / report.RESULTS).exists()
  ours = tmp_path / 'ours'
  ours.mkdir()
  (ours / report.RESULTS).write_text('[]')
  report.write_json_atomic(str(ours / report.META), report.mark({}, 'benchmark meta'))
  files.check_output_dir(str(ours), '--out_dir', ours=report.is_benchmark_dir)
  report.remove_stale(str(ours))
  assert not (ours / report.RESULTS).exists()


def test_distill_into_an_unrelated_folder_needs_force(tmp_path):
  from configs import distill_demo
  from dspec.training import distill
  (tmp_path / 'thesis.tex').write_text('years of work')
  with pytest.raises(files.OutputPathError, match='--out_dir=.*did not write.*--force'):
    distill.distill(distill_demo.get_config('tiny'), str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == ['thesis.tex']


@pytest.mark.multiprocess
def test_train_into_an_unrelated_folder_needs_force(tmp_path):
  (tmp_path / 'notes.txt').write_text('mine')
  rc, _, stderr = _run_script('train.py', '--config=configs/demo_target_v2.py:quick',
                              f'--workdir={tmp_path}', timeout=120)
  _one_error_line(rc, stderr, 'did not write')
  assert os.listdir(tmp_path) == ['notes.txt']


def test_exported_safetensors_get_the_umask_mode_and_a_dspec_mark(tmp_path):
  from dspec.models.formats.safetensors_io import write_model_dir
  old = os.umask(0o022)
  try:
    write_model_dir(tmp_path / 'out', {'a': 1}, {'w': np.zeros((2, 2), np.float32)},
                    'float32')
  finally:
    os.umask(old)
  modes = {name: stat.S_IMODE(os.stat(tmp_path / 'out' / name).st_mode)
           for name in ('model.safetensors', 'config.json')}
  assert modes == {'model.safetensors': 0o644, 'config.json': 0o644}
  assert files.written_by_dspec(str(tmp_path / 'out' / 'model.safetensors'))


# ======================================================= issue 39: API argument validation

@pytest.fixture(scope='module')
def api_target(tiny_target):
  from dspec import api
  from dspec.tokenizer import ByteTokenizer
  return api.Target(tiny_target, ByteTokenizer(), 64)   # ids only: no text is encoded


@pytest.mark.parametrize('kwargs, message', [
    (dict(prompts=None), 'prompts must be a list'),
    (dict(prompts={'a': 1}), 'prompts must be a list'),
    (dict(prompts=[b'abc']), r'prompts\[0\] must be a string or a list of token ids'),
    (dict(prompts=b'abc'), 'wrap a single prompt'),
    (dict(prompts=[[1.0, 2.0]]), r'prompts\[0\] must hold integer token ids, got 1.0'),
    (dict(prompts=[[True, 2]]), r'prompts\[0\] must hold integer token ids, got True'),
    (dict(max_new_tokens=8.0), 'max_new_tokens must be an integer, got 8.0'),
    (dict(max_new_tokens='8'), "max_new_tokens must be an integer, got '8'"),
    (dict(max_new_tokens=0), r'max_new_tokens must be in \[1,'),
    (dict(temperature=None), 'temperature must be a number, got None'),
    (dict(temperature=float('inf')), 'temperature must be a finite number'),
    (dict(top_p=0.0), 'top_p must be a finite number in \\(0'),
    (dict(top_k=2.5), 'top_k must be an integer, got 2.5'),
    (dict(seed=-1), r'seed must be in \[0,'),
    (dict(batch_size=None), 'batch_size must be an integer'),
    (dict(compare_ar='yes'), "compare_ar must be True or False, got 'yes'"),
    (dict(verify_length='fast'), "verify_length must be one of"),
    (dict(drafter='ngram'), 'drafter must come from dspec.load_drafter'),
])
def test_generate_refuses_bad_arguments_naming_them(api_target, kwargs, message):
  import dspec
  kwargs = dict(dict(prompts=[[1, 2, 3]], max_new_tokens=4), **kwargs)
  with pytest.raises(ValueError, match=message):
    dspec.generate(api_target, kwargs.pop('prompts'), **kwargs)


def test_load_functions_refuse_bad_arguments_naming_them(api_target, tmp_path):
  import dspec
  for call, message in [
      (lambda: dspec.load_target(None), 'path must be a path .*None'),
      (lambda: dspec.load_target(123), 'path must be a path .*123'),
      (lambda: dspec.load_target(b'demo/target'), 'path must be a path'),
      (lambda: dspec.load_target(str(tmp_path), max_seq_len=2.5), 'max_seq_len must be an '
       'integer'),
      (lambda: dspec.load_drafter('ngram', target='t'), 'target must come from '
       'dspec.load_target'),
      (lambda: dspec.load_drafter('ngram', target=api_target, num_draft=4.0),
       'ngram drafter field num_draft must be an integer, got 4.0'),
      (lambda: dspec.load_drafter('mtp', 7, target=api_target), 'mtp drafter field path must '
       'be a path')]:
    with pytest.raises(ValueError, match=message):
      call()


def test_a_drafter_for_another_target_is_refused_naming_both(api_target, tmp_path):
  """`generate` checks the drafter against the target it is given (not only
  `load_drafter` against its own): an MTP built for a wider target names both widths."""
  import dataclasses
  import dspec
  from dspec.models.mtp import MTP, MTPConfig, save_mtp
  wide = dataclasses.replace(TINY, embed_dim=2 * TINY.embed_dim)
  other = dspec.api.Target(Transformer(wide, rngs=nnx.Rngs(1)), api_target.tokenizer, 64)
  save_mtp(str(tmp_path / 'mtp'), MTP(MTPConfig(num_depths=1), wide, rngs=nnx.Rngs(2)))
  drafter = dspec.load_drafter('mtp', str(tmp_path / 'mtp'), target=other)
  with pytest.raises(ValueError, match=rf'width {wide.embed_dim} does not match the target '
                     rf'width {TINY.embed_dim}'):
    dspec.generate(api_target, [[1, 2, 3]], drafter, max_new_tokens=4)


def test_load_errors_are_checkpoint_errors(api_target, tmp_path):
  """What `dspec.load_target` / `load_drafter` raise for a path that holds no such model
  is `dspec.errors.CheckpointError` (a ValueError), as their docstrings say."""
  import dspec
  from dspec.errors import CheckpointError
  (tmp_path / 'file').write_text('x')
  for call in (lambda: dspec.load_target(str(tmp_path / 'missing')),
               lambda: dspec.load_target(str(tmp_path / 'file')),
               lambda: dspec.load_drafter('eagle3', str(tmp_path / 'missing'),
                                          target=api_target)):
    with pytest.raises(CheckpointError):
      call()


def test_num_draft_is_checked_with_the_prompt_against_the_context(api_target):
  import dspec
  drafter = dspec.load_drafter('ngram', target=api_target, num_draft=100000)
  with pytest.raises(ValueError, match=r'prompt of 3 tokens \+ max_new_tokens=4 \+ '
                     r'num_draft=100000 \(drafters.ngram.num_draft\) exceeds the model '
                     'context of 64 tokens'):
    dspec.generate(api_target, [[1, 2, 3]], drafter=drafter, max_new_tokens=4)


# ============================================================ issue 39: CLI config errors

def test_unknown_config_fields_name_the_path_and_near_matches():
  from configs import tiny
  cfg = tiny.get_config()
  assert config_checks.unknown_field_message(cfg, 'drafters.mtp.path') is None
  message = config_checks.unknown_field_message(cfg, 'drafters.mtp.num_drafts')
  assert message.startswith('unknown config field drafters.mtp.num_drafts: did you mean '
                            'drafters.mtp.num_draft? drafters.mtp has: num_draft, path')
  assert 'the config has: batch_size' in config_checks.unknown_field_message(cfg, 'bogus')
  assert 'is a value, not a section' in config_checks.unknown_field_message(
      cfg, 'max_new_tokens.x')


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize('script, args, message', [
    ('decode.py', ['--config.drafters.mtp.bogus=1'], 'unknown config field drafters.mtp.bogus'),
    ('decode.py', ['--config.max_new_tokns=3'], 'did you mean max_new_tokens?'),
    ('train.py', ['--config=configs/tiny.py', '--workdir=/tmp/unused_run'],
     "configs/tiny.py is not a scripts/train.py config: it has no 'training' field"),
])
def test_config_errors_are_one_line_naming_the_field(script, args, message):
  """decode.py without --config= overrides its default config (applied at parse time)."""
  rc, _, stderr = _run_script(script, *args, timeout=120)
  _one_error_line(rc, stderr, message)


# ======================================================= issue 39: errors name their file

def test_corrupt_partial_results_and_a_safetensors_directory_are_named(tmp_path):
  from dspec.bench import report
  from dspec.models.formats.safetensors_io import tensor_files
  partial = tmp_path / report.PARTIAL
  partial.write_text('{"config": "\x01')
  with pytest.raises(ValueError, match=f'{partial}: not a valid partial-results file'):
    report.read_partial(str(partial))
  (tmp_path / 'model.safetensors').mkdir()
  with pytest.raises(ValueError, match='model.safetensors: is a directory'):
    tensor_files(str(tmp_path))


# ============================================================ issue 39: locks and manifests

@pytest.mark.multiprocess
def test_a_lock_is_removed_on_exit_and_a_killed_holders_lock_is_taken_over(tmp_path):
  run = str(tmp_path / 'run')
  with files.directory_lock(run, 'distillation'):
    assert os.path.exists(os.path.join(run, files.LOCK_FILE))
  assert not os.path.exists(run)   # created by the lock, left empty: removed
  with pytest.raises(RuntimeError):
    with files.directory_lock(run, 'distillation'):
      raise RuntimeError('a run failing after taking the lock')
  assert not os.path.exists(run)
  holder = subprocess.Popen([sys.executable, '-c', textwrap.dedent(f'''
      import sys, time
      sys.path.insert(0, {REPO_ROOT!r})
      from dspec.files import directory_lock
      with directory_lock({run!r}, 'distillation'):
        print('locked', flush=True)
        time.sleep(60)''')], stdout=subprocess.PIPE, text=True)
  assert holder.stdout.readline().strip() == 'locked'
  holder.send_signal(signal.SIGKILL)
  holder.wait()
  assert os.path.exists(os.path.join(run, files.LOCK_FILE))   # left behind by kill -9
  with files.directory_lock(run, 'distillation'):              # stale: taken over
    pass
  assert os.listdir(run) == []


def test_a_manifest_without_shards_from_a_killed_run_restarts(tmp_path):
  from dspec.training import distill
  files.write_json_atomic(str(tmp_path / 'manifest.json'), {
      'fingerprint': 'other settings', 'shards': [], 'complete': False})
  manifest = distill._open_manifest(str(tmp_path), 'these settings', {'target_sha256': 'a'},
                                    3, 0.0)
  assert manifest['fingerprint'] == 'these settings' and manifest['shards'] == []
  files.write_json_atomic(str(tmp_path / 'manifest.json'), {
      'fingerprint': 'other settings', 'shards': ['shard_00000.npz'], 'complete': False})
  with pytest.raises(ValueError, match='other settings'):
    distill._open_manifest(str(tmp_path), 'these settings', {}, 3, 0.0)


# ============================================== round 4: knob ranges and stored numbers
# Every knob has a range, checked with the others before anything loads or compiles; a
# setting a mode does not honour is refused by name; numbers read from a model's files
# are finite and in range; multi-process waits are bounded.

_BAD_CONTROLLER_KNOBS = [
    (dict(tiers=(1, 3)), 'controller.tiers must be sorted, distinct and start at 0'),
    (dict(tiers=(0, 2.5)), 'controller.tiers must be an integer, got 2.5'),
    (dict(steps_per_decision=0), r'controller.steps_per_decision must be in \[1,'),
    (dict(max_steps_per_decision=10 ** 9), r'controller.max_steps_per_decision must be in'),
    (dict(chunk_seconds=math.nan), 'controller.chunk_seconds must be a finite number'),
    (dict(chunk_seconds=0.0), r'controller.chunk_seconds must be in \(0'),
    (dict(margin=-0.5), r'controller.margin must be in \[0'),
    (dict(objective='fast'), 'controller.objective must be makespan or throughput'),
    (dict(ema=math.inf), 'controller.ema must be a finite number'),
    (dict(prior=0.0), r'controller.prior must be in \(0, 1\]'),
    (dict(prior_weight=0.0), r'controller.prior_weight must be in \(0'),
    (dict(probe_every=64, max_probe_every=32),
     'controller.probe_every=64 must be <= controller.max_probe_every=32'),
    (dict(max_probe_every=-1), r'controller.max_probe_every must be in \[1,'),
    (dict(shadow_probes='yes'), 'controller.shadow_probes must be True or False'),
    (dict(profile_steps=0), r'controller.profile_steps must be in \[1,'),
    (dict(profile_repeats=0), r'controller.profile_repeats must be in \[1,'),
    (dict(shadow_budget=math.nan), 'controller.shadow_budget must be a finite number'),
    (dict(shadow_warmup=-1), r'controller.shadow_warmup must be in \[0,'),
]


@pytest.mark.parametrize('knobs, message', _BAD_CONTROLLER_KNOBS)
def test_every_controller_knob_has_a_range(knobs, message):
  from dspec.decoding.policy import ControllerConfig
  tried = {name for cases, _ in _BAD_CONTROLLER_KNOBS for name in cases}
  assert tried == {f.name for f in dataclasses.fields(ControllerConfig)}   # a case each
  with pytest.raises(cli.UserError, match=message):
    ControllerConfig(**knobs)
  with pytest.raises(cli.UserError, match=message):   # --config.controller.<knob>
    ControllerConfig.from_config(dict(dataclasses.asdict(ControllerConfig()), **knobs))


@pytest.mark.parametrize('tree, message', [
    (dict(top_k=10 ** 9), 'tree.top_k=1000000000 must be <= tree.num_nodes=32'),
    (dict(num_nodes=8, top_k=9), 'tree.top_k=9 must be <= tree.num_nodes=8'),
    (dict(num_nodes=2.5), 'tree.num_nodes must be an integer, got 2.5'),
    (dict(top_k=math.nan), 'tree.top_k must be an integer, got nan'),
    (dict(nodes=8), r"tree: unknown knobs \['nodes'\]"),
])
def test_tree_knobs_are_bounded(tree, message):
  from dspec.decoding.tree_engine import TreeConfig
  with pytest.raises(cli.UserError, match=message):
    TreeConfig.from_config(tree)


def _block_drafter(kind, **fields):
  """A DFlash or DSpark drafter with no weights (enough to build engines, not to run)."""
  from dspec.decoding.drafters.dflash import DFlashDrafter
  from dspec.decoding.drafters.dspark import DSparkDrafter
  from dspec.models.dflash import DFlashConfig
  from dspec.models.dspark import DSparkConfig
  if kind == 'dflash':
    return DFlashDrafter(None, DFlashConfig.create(TINY.num_layers, 1, 5, 0), TINY, 4,
                         **fields)
  return DSparkDrafter(None, DSparkConfig.create(TINY.num_layers, 1, 4, 0, markov_rank=8),
                       TINY, 4, **fields)


@pytest.mark.parametrize('kind, fields, verify_length, message', [
    ('dflash', dict(denoise_steps=2), 'tree', 'drafters.dflash.denoise_steps=2'),
    ('dspark', dict(verify_budget=3), 'auto_tree', 'drafters.dspark.verify_budget=3'),
    ('dspark', dict(verify_cost=0.5, verify_budget=2), 'tree',
     'drafters.dspark.verify_budget=2, drafters.dspark.verify_cost=0.5: leave them'),
])
def test_tree_modes_refuse_drafter_settings_they_ignore(kind, fields, verify_length,
                                                        message):
  from dspec.decoding import runner
  from dspec.sampling import SamplingSpec
  build = lambda drafter, mode: runner.speculative_engine(None, drafter, SamplingSpec(), (),
                                                          verify_length=mode)
  with pytest.raises(cli.UserError, match=f'verify_length={verify_length} does not honour '
                     f'{message}'):
    build(_block_drafter(kind, **fields), verify_length)
  build(_block_drafter(kind, **fields), 'fixed')      # honoured there
  build(_block_drafter(kind), verify_length)          # the defaults are what trees do


@pytest.mark.parametrize('setting, message', [
    (('controller', 'profile_repeats', 0), r'controller.profile_repeats must be in \[1,'),
    (('controller', 'chunk_seconds', math.nan), 'controller.chunk_seconds must be a fin'),
    (('tree', 'top_k', 10 ** 9), 'tree.top_k=1000000000 must be <='),
    (('drafters.dflash', 'denoise_steps', 3), 'not honour drafters.dflash.denoise_steps=3'),
    (('', 'verify_length', 'fast'), 'verify_length must be one of'),
])
def test_the_decode_job_checks_every_knob_before_loading(setting, message):
  """The target and drafter paths do not exist: an error about them means the knob was
  checked only after loading began (or not at all)."""
  from dspec.decoding import runner
  cfg = common.decode_config('tiny')
  cfg.model.update(source='checkpoint', path='/nonexistent/target')
  cfg.drafters.dflash.path = '/nonexistent/dflash'
  cfg.update(drafter='dflash', verify_length='tree')
  section, name, value = setting
  node = cfg
  for part in filter(None, section.split('.')):
    node = node[part]
  node[name] = value
  with pytest.raises(cli.UserError, match=message):
    runner.run_decode(cfg)


def _edit_metadata(path, edit):
  meta = os.path.join(path, 'metadata', 'metadata')
  with open(meta) as f:
    data = json.load(f)
  edit(data['config'])
  with open(meta, 'w') as f:
    json.dump(data, f)


@pytest.mark.parametrize('edit, message', [
    (lambda c: c.update(rope_theta=math.nan), 'config.rope_theta must be a finite number'),
    (lambda c: c.update(norm_eps=-1e-6), r'config.norm_eps must be in \(0, 1\)'),
    (lambda c: c.update(embed_dim=math.inf), 'config.embed_dim must be a finite number'),
])
def test_stored_target_config_numbers_are_checked(tmp_path, tiny_target, edit, message):
  path = tmp_path / 'ckpt'
  _save_target(path, tiny_target)
  _edit_metadata(path, edit)
  where = re.escape(str(path))
  with pytest.raises(CheckpointError, match=f'{where}: bad metadata: {message}'):
    checkpoint.read_model_metadata(path, 'target')


def test_stored_drafter_config_numbers_are_checked_on_save_and_load(tmp_path):
  """A DSpark config whose calibration holds a NaN (which would switch its verify rule
  off): refused when saved, and when read from a damaged checkpoint."""
  temperatures = [1.0, math.nan, 1.0, 1.0]
  config = {'dspark': {'block_size': 4, 'confidence_temperatures': temperatures},
            'target': TINY.to_dict()}
  with pytest.raises(CheckpointError, match=r'refusing to save: config.dspark.'
                     r'confidence_temperatures\[1\] must be a finite number, got nan'):
    checkpoint.save_model(tmp_path / 'nan', _Toy(), kind='dspark', config=config)
  assert not (tmp_path / 'nan').exists()
  temperatures[1] = 2.0
  checkpoint.save_model(tmp_path / 'ok', _Toy(), kind='dspark', config=config)
  checkpoint.read_model_metadata(tmp_path / 'ok', 'dspark')
  for value, message in [(-1.0, r'must be in \(0'), (math.inf, 'must be a finite number')]:
    _edit_metadata(tmp_path / 'ok',
                   lambda c: c['dspark']['confidence_temperatures'].__setitem__(1, value))
    with pytest.raises(CheckpointError, match=rf'confidence_temperatures\[1\] {message}'):
      checkpoint.read_model_metadata(tmp_path / 'ok', 'dspark')
  _edit_metadata(tmp_path / 'ok', lambda c: c['dspark'].update(block_size=1))
  with pytest.raises(CheckpointError, match=r'config.dspark.block_size must be in \[2,'):
    checkpoint.read_model_metadata(tmp_path / 'ok', 'dspark')


@pytest.mark.parametrize('text, message', [
    ('{"dspec_confidence_temperatures": [1.0, NaN]}',
     r'dspec_confidence_temperatures\[1\] must be a finite number, got nan'),
    ('{"transformer_layer_config": {"rms_norm_eps": -1e-6}}',
     r'transformer_layer_config.rms_norm_eps must be in \(0, 1\)'),
    ('{"rope_theta": 1e999}', 'rope_theta must be a finite number, got inf'),
    ('{"dflash_config": {"mask_token_id": -1}}',
     r'dflash_config.mask_token_id must be in \[0,'),
    ('{"initializer_range": Infinity}', 'initializer_range must be a finite number'),
])
def test_config_json_numbers_are_checked_naming_the_file(tmp_path, text, message):
  from dspec.models.formats.drafter_dir import FormatError, read_json
  (tmp_path / 'config.json').write_text(text)
  where = re.escape(str(tmp_path / 'config.json'))
  with pytest.raises(FormatError, match=f'{where}: {message}'):
    read_json(str(tmp_path / 'config.json'))
  with pytest.raises(ValueError, match=f'{where}: {message}'):
    read_hf_config(tmp_path)


@pytest.mark.parametrize('timeout', [math.nan, math.inf, 0.0, -5.0, 1e12])
def test_distributed_timeout_must_be_a_finite_bounded_wait(timeout):
  """A NaN or infinite timeout retried the coordinator forever."""
  from dspec import distributed
  with pytest.raises(cli.UserError, match='--distributed_timeout must be'):
    distributed.check_arguments('127.0.0.1:1', 2, 1, timeout)
  distributed.check_arguments('127.0.0.1:1', 2, 1, 4.0)


@pytest.mark.parametrize('flag', ['--timeout=nan', '--timeout=inf', '--grace=nan',
                                  '--grace=inf', '--grace=-1'])
def test_launch_local_refuses_unbounded_waits(flag, capsys, monkeypatch):
  monkeypatch.syspath_prepend(os.path.join(REPO_ROOT, 'scripts'))
  import launch_local   # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit) as exit_info:
    launch_local._parse(['-n', '2', flag, '--', os.path.join(REPO_ROOT, 'scripts',
                                                            'decode.py')])
  assert exit_info.value.code == 2
  errors = capsys.readouterr().err.strip().splitlines()
  assert len(errors) == 1, errors
  name = flag.split('=')[0]
  assert errors[0].startswith(f'error: {name} must be a finite number'), errors


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize('args, message', [
    (['--config=configs/tiny.py', '--config.controller.profile_repeats=0'],
     'controller.profile_repeats must be in [1,'),
    (['--config=configs/tiny.py', '--coordinator=127.0.0.1:9', '--num_processes=2',
      '--process_id=1', '--distributed_timeout=nan'],
     '--distributed_timeout must be a finite number, got nan'),
])
def test_bad_knobs_are_one_error_line_from_decode(args, message):
  rc, _, stderr = _run_script('decode.py', *args, timeout=120)
  _one_error_line(rc, stderr, message)


# ================================ round 4: outputs inside inputs, replacing, write failures
# Every script's output flags go through one policy (`files.check_outputs`), which refuses
# an output inside any input of the run; --force replaces a dspec output whole and a folder
# never holds two models; a failed write is one line naming the output and replaces
# nothing; one error hierarchy (`dspec.errors`) for the API and the scripts.

_OUTPUT_FLAG = re.compile(r'(^|_)(out|json|table)($|_)(?!schema)|workdir')   # json_schema: an input
_INPUT_FLAGS = ('path', 'target', 'data', 'hf_dir', 'checkpoint', 'data_dir', 'drafters')
# Scripts whose output checks live in the library function they call.
_CHECKED_IN = {'distill.py': 'dspec/training/distill.py'}


def _script_flags(source):
  return re.findall(r"DEFINE_\w+\(\s*'(\w+)'", source) + re.findall(
      r"add_argument\(\s*'--(\w+)'", source)


def test_every_script_output_flag_goes_through_the_output_policy():
  """A source scan: each output flag of a script (--out, --out_dir, --json, --table,
  --workdir, --*_json, ...) is named in a `files.check_outputs` call, with the script's
  path inputs (and its config's, `config_inputs`) as inputs; a new script cannot skip it."""
  checked = []
  for script in sorted(glob.glob(os.path.join(REPO_ROOT, 'scripts', '*.py'))):
    name = os.path.basename(script)
    source = open(script).read()
    outputs = [f for f in _script_flags(source) if _OUTPUT_FLAG.search(f)]
    if not outputs:
      continue
    checks = source + (open(os.path.join(REPO_ROOT, _CHECKED_IN[name])).read()
                       if name in _CHECKED_IN else '')
    assert 'check_outputs(' in checks, f'{name}: output flags {outputs} skip check_outputs'
    for flag in outputs:
      assert re.search(f"'--{flag}['\\[]", checks), f'{name}: --{flag} is not checked'
    for flag in set(_script_flags(source)) & set(_INPUT_FLAGS):
      assert re.search(f"'--{flag}['=]", checks), f'{name}: input --{flag} is not an input'
    if re.search(r"define_config\(|DEFINE_config_file\(", source):
      assert 'config_inputs(' in checks, f'{name}: its config\'s inputs are not inputs'
    checked.append(name)
  assert {'eval_drafter.py', 'bench_trees.py', 'benchmark.py', 'export_drafter.py',
          'decode.py', 'redteam.py', 'bench_concurrency.py'} <= set(checked), checked


def test_a_run_may_not_write_inside_any_input_of_its_config(tmp_path):
  from configs import bench_demo
  cfg = bench_demo.get_config('quick')
  inputs = files.config_inputs(cfg)
  assert inputs['--config.model.path'] == cfg.model.path
  assert {'--config.data_dir', '--config.drafters.mtp.path', '--config.model.tokenizer_dir',
          '--config.bench.variants.mtp_vocab.token_map'} <= set(inputs)
  never = {'--out_dir': lambda d: False}
  for out, named in [(os.path.join(cfg.data_dir, 'bench'), '--config.data_dir'),
                     (cfg.model.path, '--config.model.path'),
                     (os.path.join(cfg.drafters.mtp.path, 'x'), '--config.drafters.mtp')]:
    with pytest.raises(files.OutputPathError, match=f'inside the input {named}'):
      files.check_outputs({'--out_dir': out}, inputs, dirs=never)
  files.check_outputs({'--out_dir': str(tmp_path / 'bench')}, inputs, dirs=never)


@pytest.mark.multiprocess
def test_eval_drafter_refuses_an_out_inside_the_drafter_it_reads():
  drafter = os.path.join(REPO_ROOT, 'demo', 'dflash2')
  rc, _, stderr = _run_script('eval_drafter.py', '--kind=dflash2', f'--path={drafter}',
                              f'--out={drafter}/eval.json', timeout=120)
  _one_error_line(rc, stderr, 'inside the input --path')
  assert not os.path.exists(os.path.join(drafter, 'eval.json'))


def _eagle3(seed):
  from dspec.models.eagle3 import Eagle3Config, Eagle3Model
  return Eagle3Model(Eagle3Config(target_layer_ids=(1, 0), final_tap_normed=True), TINY,
                     rngs=nnx.Rngs(seed))


def _first_weight(model):
  params = checkpoint.leaf_paths(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  return np.asarray(params[min(params)])


def test_force_replaces_a_checkpoint_whole_and_a_folder_never_holds_two_drafters(tmp_path):
  from dspec.models.eagle3 import save_eagle3
  from dspec.models.formats import kind_of
  from dspec.models.formats.eagle3 import load_eagle3, save_speculators
  first, second = _eagle3(0), _eagle3(1)
  out = tmp_path / 'drafter'
  save_eagle3(out, first)
  with pytest.raises(files.OutputPathError, match=r"holds another model's files \(metadata"):
    save_speculators(out, second)                   # no force: the checkpoint stays
  np.testing.assert_array_equal(_first_weight(load_eagle3(str(out), target_cfg=TINY)),
                                _first_weight(first))
  save_speculators(out, second, force=True)         # force: replaced whole
  assert sorted(os.listdir(out)) == ['config.json', 'model.safetensors']
  assert sorted(os.listdir(tmp_path)) == ['drafter']   # nothing left beside it
  np.testing.assert_array_equal(_first_weight(load_eagle3(str(out), target_cfg=TINY)),
                                _first_weight(second))
  with pytest.raises(CheckpointError, match='not a dspec checkpoint'):
    save_eagle3(out, first, force=True)             # a save never mixes into an export
  # A folder holding two drafters' files (however it came about) is refused by name.
  mixed = tmp_path / 'mixed'
  save_eagle3(mixed, first)
  for name in ('config.json', 'model.safetensors'):
    (mixed / name).write_bytes((out / name).read_bytes())
  for load in (lambda: load_eagle3(str(mixed), target_cfg=TINY), lambda: kind_of(mixed)):
    with pytest.raises(CheckpointError, match=re.escape(
        f"{mixed}: holds two models' files, a dspec checkpoint (metadata/, state/) and "
        'config.json, model.safetensors')):
      load()


def test_a_target_folder_with_two_models_is_refused(tmp_path, tiny_target):
  import dspec
  from dspec.hf_export import export_to_hf
  path = tmp_path / 'target'
  _save_target(path, tiny_target)
  export_to_hf(tiny_target, tmp_path / 'hf')
  for name in ('config.json', 'model.safetensors'):
    (path / name).write_bytes((tmp_path / 'hf' / name).read_bytes())
  with pytest.raises(CheckpointError, match="holds two models' files"):
    dspec.load_target(str(path))


def test_a_failed_file_write_names_the_output_and_replaces_nothing(tmp_path):
  out = tmp_path / 'm.json'
  files.write_json_atomic(str(out), files.mark({'v': 1}, 'test'))

  def fail(tmp):
    open(tmp, 'w').write('{"v": ')
    raise OSError(28, 'No space left on device', tmp)

  with pytest.raises(files.WriteError, match=f'^{re.escape(str(out))}: cannot write it '
                     r'\(No space left on device\)'):
    files.write_atomic(str(out), fail)
  assert json.loads(out.read_text())['v'] == 1
  assert sorted(os.listdir(tmp_path)) == ['m.json']


def test_a_failed_export_keeps_the_previous_one_and_leaves_no_folder(tmp_path, monkeypatch):
  from safetensors import SafetensorError
  from dspec.models.formats import safetensors_io
  from dspec.models.formats.eagle3 import save_speculators
  out = tmp_path / 'export'
  save_speculators(out, _eagle3(0))
  before = {n: (out / n).read_bytes() for n in os.listdir(out)}

  def full_disk(*args, **kw):
    raise SafetensorError('Error while serializing: I/O error: No space left on device '
                          '(os error 28)')

  monkeypatch.setattr(safetensors_io, 'save_file', full_disk)
  for where in (out, tmp_path / 'new'):
    with pytest.raises(files.WriteError, match=f'{re.escape(str(where))}: cannot write it '
                       r'\(No space left on device\)'):
      save_speculators(where, _eagle3(1), force=True)
  assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
  assert sorted(os.listdir(tmp_path)) == ['export']


def test_a_failed_checkpoint_save_keeps_the_previous_one(tmp_path, tiny_target, monkeypatch):
  """Orbax reports a full disk as tensorstore's ValueError; its partial temporary folder
  is removed."""
  path = tmp_path / 'ckpt'
  _save_target(path, tiny_target, extra={'v': 1})
  real = checkpoint._checkpointer

  class FullDisk:
    def save(self, where, **kw):
      os.makedirs(f'{where}.orbax-checkpoint-tmp/state')
      raise ValueError(f'RESOURCE_EXHAUSTED: Error writing "w/0.0" at "{where}": Failed to '
                       "write 201526 bytes: No space left on device [os_error_code='28']")

  monkeypatch.setattr(checkpoint, '_checkpointer', FullDisk)
  for where, force in ((path, True), (tmp_path / 'new', False)):
    with pytest.raises(files.WriteError, match=f'^{re.escape(str(where))}: cannot write it '
                       r'\(No space left on device\)'):
      _save_target(where, tiny_target, force=force)
  monkeypatch.setattr(checkpoint, '_checkpointer', real)
  assert checkpoint.read_model_metadata(path, 'target')['extra'] == {'v': 1}
  assert sorted(os.listdir(tmp_path)) == ['ckpt']


def test_a_read_only_directory_is_one_error_naming_the_output(tmp_path, monkeypatch):
  from dspec.models.formats.eagle3 import save_speculators
  parent = tmp_path / 'ro'
  parent.mkdir()
  if os.geteuid() == 0:   # root writes through chmod: the kernel's refusal, monkeypatched
    def read_only(path, *args, **kw):
      raise OSError(30, 'Read-only file system', str(path))
    monkeypatch.setattr(os, 'mkdir', read_only)
    monkeypatch.setattr(files, 'open', read_only, raising=False)
  else:
    os.chmod(parent, 0o555)
  try:
    for write in (lambda: save_speculators(parent / 'x', _eagle3(0)),
                  lambda: files.write_json_atomic(str(parent / 'm.json'), {'a': 1})):
      with pytest.raises(files.WriteError, match=f'{re.escape(str(parent))}/(x|m.json): '
                         'cannot write it'):
        write()
  finally:
    monkeypatch.undo()
    os.chmod(parent, 0o755)
  assert os.listdir(parent) == []


def test_one_error_hierarchy_for_the_api_and_the_scripts(api_target, tmp_path):
  """Bad input and bad files are ValueErrors, refused or failed outputs OSErrors, all of
  them DspecErrors; each API function raises what its docstring says."""
  import dspec
  from dspec import errors
  from dspec.models.formats.drafter_dir import FormatError
  for cls in (errors.UserError, CheckpointError, FormatError):
    assert issubclass(cls, errors.DspecError) and issubclass(cls, ValueError)
  for cls in (files.OutputPathError, files.WriteError, files.LockedError):
    assert issubclass(cls, errors.DspecError) and issubclass(cls, OSError)
  assert cli.UserError is errors.UserError and checkpoint.CheckpointError is CheckpointError
  drafter = tmp_path / 'drafter'
  checkpoint.save_model(drafter, _Toy(), kind='mtp', config={})
  target = tmp_path / 'target'
  _save_target(target, api_target.model)
  for function, call, error in [
      (dspec.load_target, lambda: dspec.load_target(str(drafter)), CheckpointError),
      (dspec.load_target, lambda: dspec.load_target(123), ValueError),
      (dspec.load_drafter, lambda: dspec.load_drafter('mtp', str(target), target=api_target),
       CheckpointError),
      (dspec.load_drafter, lambda: dspec.load_drafter('ngram', target=api_target,
                                                      num_draft=4.0), ValueError),
      (dspec.generate, lambda: dspec.generate(api_target, None), ValueError)]:
    assert error.__name__ in function.__doc__, function.__name__
    with pytest.raises(error):
      call()
    try:
      call()
    except ValueError:   # one `except` catches bad arguments and bad checkpoints alike
      pass


# ================================ round 4: launch_local's children die with it
# However the launcher ends (SIGHUP, SIGKILL, a reader that closed its stdout), no process
# it started is left running or blocked.

_CHILD = '''import os, sys, time
print(os.getpid(), flush=True)
if sys.argv[1:2] == ['chatty']:
  for _ in range(4000):
    print('x' * 100, flush=True)
  sys.exit(0)
time.sleep(120)
'''


def _launch(tmp_path, *child_args, **popen):
  child = tmp_path / 'child.py'
  child.write_text(_CHILD)
  return subprocess.Popen([sys.executable, os.path.join(REPO_ROOT, 'scripts', 'launch_local.py'),
                           '-n', '1', '--timeout=60', '--grace=1', '--', str(child),
                           *child_args], **popen)


def _child_pid(launcher) -> int:
  line = launcher.stdout.readline().decode()
  return int(line.split()[-1])


def _gone(pid: int, within: float = 10.0) -> bool:
  deadline = time.monotonic() + within
  while time.monotonic() < deadline:
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return True
    time.sleep(0.1)
  return False


@pytest.mark.multiprocess
@pytest.mark.parametrize('sig', [signal.SIGHUP, signal.SIGKILL])
def test_launch_local_children_die_with_it(tmp_path, sig):
  launcher = _launch(tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
  try:
    child = _child_pid(launcher)
    launcher.send_signal(sig)
    launcher.wait(timeout=30)
    assert _gone(child), f'the child outlived a launcher killed by {sig.name}'
  finally:
    launcher.kill()
    launcher.wait()


@pytest.mark.multiprocess
def test_launch_local_drains_a_closed_stdout(tmp_path):
  """A child writing far more than a pipe holds, to a launcher whose reader went away,
  still finishes: the launcher exits 0 at once, not at its timeout."""
  read_end, write_end = os.pipe()
  os.close(read_end)
  t0 = time.monotonic()
  launcher = _launch(tmp_path, 'chatty', stdout=write_end, stderr=subprocess.DEVNULL)
  os.close(write_end)
  assert launcher.wait(timeout=50) == 0
  assert time.monotonic() - t0 < 40
