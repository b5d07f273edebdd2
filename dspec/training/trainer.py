"""A generic, resumable train loop (optax + orbax) shared by every objective.

A `TrainTask` says what is trained (an NNX module), what stays frozen (passed through
untouched, e.g. the target under a drafter), the loss, and a deterministic batch for every
step, so a resumed run sees exactly the batches it would have seen.

Across processes (`dspec.distributed`) training is data-parallel over one global mesh
(`training.mesh`, else `data=<every device>`): each process feeds its devices' rows of the
step's global batch, every process saves and restores the checkpoints collectively (orbax),
and only process 0 logs, writes `train_log.jsonl` and holds the workdir lock; a stop
(SIGTERM, `max_minutes`) is agreed, so every process stops at the same step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from tqdm import tqdm
from absl import logging
from flax import nnx

from dspec import checkpoint, config_checks, distributed, files, sharding
from dspec.errors import UserError
from dspec.training import optimizer as optimizer_lib


class TrainingDiverged(ValueError):
  """The loss or gradient became NaN or Inf; the run stopped without saving that state."""


@dataclasses.dataclass
class TrainTask:
  """What one training run optimises.

  loss_fn(model, frozen, batch, key) -> (loss, metrics dict of scalars)
  get_batch(step) -> dict of numpy arrays (deterministic in step)
  evaluate(model, frozen) -> dict of floats (held-out metrics), or None
  export(model, path, step) writes the model (dspec checkpoint) with `train_step=step` in its
    metadata's `extra`, so training can continue from it on another machine.
  """

  model: nnx.Module
  frozen: Any
  loss_fn: Callable
  get_batch: Callable[[int], dict]
  evaluate: Optional[Callable] = None
  export: Optional[Callable] = None


class _StopRequest:
  """Turns SIGTERM (a preemption, `kill`, a session ending) into a stop at the end of the
  current step: the loop then checkpoints and exports as at `max_minutes`."""

  def __init__(self):
    self.signal_name = None
    self._previous = None

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._request)
    return self

  def _request(self, signum, frame):
    del frame
    self.signal_name = signal.Signals(signum).name

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


def _restore_newest_intact(ckpt: checkpoint.TrainCheckpointer, abstract):
  """(step, tree) of the newest checkpoint that restores intact, or (None, None) if none.

  Damaged newer steps (unreadable, or an array failing its checksum) are renamed to
  `corrupt_<step>` once an older intact one is found, and a warning says so. When no step
  restores, nothing is renamed and the newest step's error is raised.
  """
  damaged = []
  for step in sorted(ckpt.all_steps(), reverse=True):
    try:
      tree, _ = ckpt.restore(step, abstract)
    except checkpoint.CheckpointError as e:
      damaged.append((step, e))
      continue
    for bad_step, err in damaged if distributed.is_main() else ():
      moved = ckpt.quarantine(bad_step)
      print(f'warning: {err}; moved it to {moved} and resuming from the older intact '
            f'checkpoint at step {step}', file=sys.stderr, flush=True)
    return step, tree
  if damaged:
    step, err = damaged[0]
    older = f' (and {len(damaged) - 1} older steps)' if len(damaged) > 1 else ''
    raise checkpoint.CheckpointError(f'{err}{older}; no intact checkpoint to resume from: '
                                     f'move {ckpt.directory} away to start over')
  return None, None


def _trim_log(log_path: str, step: int) -> None:
  """Drops `train_log.jsonl` entries after `step` (and torn lines): a resumed run
  re-logs those steps."""
  if not os.path.exists(log_path):
    return
  keep, dropped = [], 0
  with open(log_path) as f:
    for line in f:
      try:
        entry = json.loads(line)
        ok = line.endswith('\n') and (not isinstance(entry, dict)
                                       or entry.get('step', 0) <= step)
      except json.JSONDecodeError:
        ok = False
      if ok:
        keep.append(line)
      else:
        dropped += 1
  if dropped:
    files.write_text_atomic(log_path, ''.join(keep))
    print(f'{log_path}: dropped {dropped} entries after step {step} (they are re-run)',
          flush=True)


def train(task: TrainTask, cfg, workdir: str) -> dict:
  """Runs (or resumes) training; returns the last logged and eval metrics.

  cfg: the `training` ConfigDict (num_steps, learning_rate, warmup_ratio, weight_decay,
  grad_clip, b1, b2, seed, log_every, eval_every, ckpt_every, max_minutes; optional
  mesh and sharding_rules: params, optimizer state and the frozen model are then sharded
  (fsdp + tensor, `dspec/sharding.py`) and batches split over the batch axes).

  Resuming: the newest intact checkpoint under `workdir/checkpoints` restores everything
  (params, optimizer moments, step); a damaged newer one is set aside as `corrupt_<step>`
  with a warning. Without one, `continue_from_init=True` makes a warm restart from the
  export at `init_from` (which the task loaded into the model): training continues at the
  step recorded in it, the schedule where it was, with fresh optimizer moments.
  `export_every` > 0 also exports the model to `workdir/export` every that many steps.
  `train_log.jsonl` is trimmed to the resumed step. A resume with no steps left never
  rewrites `final/`: at `num_steps` it returns at once (or writes a missing `final/`), past
  it it is refused.

  SIGTERM stops the run at the end of the current step, checkpointed and exported (no eval).
  One trainer per workdir (a lock refuses a second one). A NaN/Inf loss or gradient stops
  the run with TrainingDiverged naming the step; that state is neither logged nor saved.
  """
  config_checks.check_training_config(cfg)
  with workdir_lock(workdir), _StopRequest() as stop:
    return _train(task, cfg, workdir, stop)


def workdir_lock(workdir: str):
  """The trainer's lock on `workdir`, held by process 0 of a multi-process run."""
  if distributed.is_main():
    return files.directory_lock(workdir, 'trainer')
  return contextlib.nullcontext()


def _placement(cfg, model):
  """`training.mesh`'s Placement; across processes without one, data parallel over every
  process's devices. The batch must split over the mesh's batch axes."""
  model_cfg = sharding.find_model_config(model)
  placement = sharding.placement_from_config(cfg, model_cfg)
  if placement is None and distributed.active():
    placement = sharding.Placement.create('data=-1', model_cfg=model_cfg)
  if placement is not None and cfg.batch_size % placement.batch_size_multiple:
    raise UserError(f'training.batch_size={cfg.batch_size} does not split over the '
                    f'{placement.batch_size_multiple} batch shards of the mesh '
                    f'{dict(placement.mesh.shape)}: use a multiple of it')
  return placement


def _train(task: TrainTask, cfg, workdir: str, stop: _StopRequest) -> dict:
  optimizer = optimizer_lib.make_optimizer(cfg)
  graphdef, params, rest = nnx.split(task.model, nnx.Param, ...)
  print(f'trainable parameters: {sum(x.size for x in jax.tree.leaves(params)):,}', flush=True)
  placement = _placement(cfg, task.model)
  frozen = task.frozen
  if placement:
    params, rest = placement.put_params(params), placement.put_params(rest)
    frozen = sharding.place_tree(frozen, placement)
  opt_state = placement.init_sharded(optimizer.init, params) if placement else \
      optimizer.init(params)

  ckpt = checkpoint.TrainCheckpointer(os.path.join(workdir, 'checkpoints'),
                                      max_to_keep=2)
  try:
    return _train_loop(task, cfg, workdir, ckpt, optimizer, graphdef, params, rest, frozen,
                       opt_state, placement, stop)
  finally:
    ckpt.close()


def _train_loop(task, cfg, workdir, ckpt, optimizer, graphdef, params, rest, frozen,
                opt_state, placement, stop) -> dict:
  start_step = 0
  latest, restored = _restore_newest_intact(ckpt, {'params': params, 'opt_state': opt_state})
  if latest is not None:
    params, opt_state = restored['params'], restored['opt_state']
    if placement:
      params, opt_state = placement.put_params(params), placement.put_params(opt_state)
    start_step = latest
    logging.info('resumed from step %d', latest)
  elif cfg.get('continue_from_init') and cfg.get('init_from'):
    start_step = checkpoint.read_train_step(cfg.init_from)
    opt_state = optimizer_lib.set_step(opt_state, start_step)
    print(f'warm restart from {cfg.init_from} at step {start_step} (fresh optimizer moments)',
          flush=True)
  final_path = os.path.join(workdir, 'final')
  if start_step > cfg.num_steps:
    raise UserError(f'{workdir} is already at step {start_step}, past training.num_steps='
                    f'{cfg.num_steps}: nothing to train (raise training.num_steps to go on; '
                    'final/ is left as it is)')
  if start_step == cfg.num_steps and (task.export is None or os.path.exists(final_path)):
    print(f'nothing to train: {workdir} is already at training.num_steps={cfg.num_steps} '
          '(final/ is left as it is)', flush=True)
    return {'last': {}, 'eval': {}, 'steps': 0}
  log_path = os.path.join(workdir, 'train_log.jsonl')
  main = distributed.is_main()
  if main:
    _trim_log(log_path, start_step)

  def loss_of_params(p, frozen, batch, key):
    return task.loss_fn(nnx.merge(graphdef, p, rest), frozen, batch, key)

  def train_step(p, opt_state, frozen, batch, key, done, first_bad):
    (loss, metrics), grads = jax.value_and_grad(loss_of_params, has_aux=True)(
        p, frozen, batch, key)
    updates, opt_state = optimizer.update(grads, opt_state, p)
    p = optax.apply_updates(p, updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
    finite = jnp.isfinite(loss) & jnp.isfinite(metrics['grad_norm'])
    first_bad = jnp.where((first_bad < 0) & ~finite, done, first_bad)
    return p, opt_state, metrics, first_bad

  if placement:
    train_step = placement.jit(train_step, donate_argnums=(0, 1), out_shardings=(
        placement.shardings(placement.param_specs(params)),
        placement.shardings(placement.param_specs(opt_state)), None, None))
  else:   # the train state is donated: one copy of params and moments in memory
    train_step = jax.jit(train_step, donate_argnums=(0, 1))

  def check_finite(first_bad):
    bad = int(first_bad)
    if bad >= 0:
      raise TrainingDiverged(
          f'non-finite loss or gradient at step {bad} (training.learning_rate='
          f'{cfg.learning_rate}); stopped without saving it, the last checkpoint is kept: '
          'lower the learning rate or check the data')

  base_key = jax.random.key(cfg.seed)
  t_start = time.time()
  last, evals = {}, {}
  first_bad = jnp.asarray(-1, jnp.int32)
  done = start_step
  with tqdm(total=cfg.num_steps, initial=start_step, desc='train', unit='step',
             dynamic_ncols=True, file=sys.stderr) as bar:   # closed before an error line is printed
    for step in range(start_step, cfg.num_steps):
      batch = task.get_batch(step)
      if distributed.active():   # each process feeds its devices' rows
        batch = distributed.global_batch(batch, placement)
      elif placement:
        batch = placement.put_batch(jax.tree.map(jnp.asarray, batch))
      else:
        batch = jax.tree.map(jnp.asarray, batch)
      done = step + 1
      params, opt_state, metrics, first_bad = train_step(
          params, opt_state, frozen, batch, jax.random.fold_in(base_key, step), done, first_bad)
      bar.update()
      out_of_time = bool(cfg.max_minutes) and (time.time() - t_start) > 60 * cfg.max_minutes
      signalled = stop.signal_name   # read once: a signal may land during this step's I/O
      if distributed.active():   # every process stops at the same step
        out_of_time, anywhere = distributed.any_process((out_of_time, signalled is not None))
        signalled = signalled or ('SIGTERM on another process' if anywhere else None)
      stopping = out_of_time or signalled is not None
      export_now = task.export is not None and (
          signalled is not None or (cfg.get('export_every') and done % cfg.export_every == 0))
      log_now = done % cfg.log_every == 0 or done == cfg.num_steps or stopping
      ckpt_now = done % cfg.ckpt_every == 0 or done == cfg.num_steps or stopping
      if log_now or ckpt_now or export_now:
        check_finite(first_bad)
      if log_now:
        last = {k: float(v) for k, v in metrics.items()}
        last.update(step=done, elapsed_s=round(time.time() - t_start, 1))
        if task.evaluate is not None and (done % cfg.eval_every == 0 or done == cfg.num_steps
                                          or out_of_time):
          evals = task.evaluate(nnx.merge(graphdef, params, rest), task.frozen)
          last.update({f'eval/{k}': v for k, v in evals.items()})
        logging.info('step %d %s', done, json.dumps(last))
        bar.set_postfix(loss=f"{last['loss']:.3f}")
        tqdm.write(json.dumps(last), file=sys.stdout)
        if main:
          with open(log_path, 'a') as f:
            f.write(json.dumps(last) + '\n')
      if ckpt_now:
        ckpt.save(done, {'params': params, 'opt_state': opt_state}, {'step': done})
        ckpt.wait()   # the next step donates these buffers: the save must have read them
      if export_now:
        task.export(nnx.merge(graphdef, params, rest), os.path.join(workdir, 'export'), done)
      if signalled is not None:
        print(f'stopping at step {done}: {signalled} received', flush=True)
        break
      if out_of_time:
        logging.warning('stopping at step %d: max_minutes=%s reached', done, cfg.max_minutes)
        break
  check_finite(first_bad)
  ckpt.wait()
  model = nnx.merge(graphdef, params, rest)
  if task.export is not None:
    if done == start_step:
      print(f'no steps left to train: writing the missing {final_path} from step {done}',
            flush=True)
    task.export(model, final_path, done)
  return {'last': last, 'eval': evals, 'steps': done - start_step}
