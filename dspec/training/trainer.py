"""A generic, resumable train loop (optax + orbax) shared by every objective.

A `TrainTask` says what is trained (an NNX module), what stays frozen (passed through
untouched, e.g. the target under a drafter), the loss, and a deterministic batch for every
step, so a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx

from dspec import checkpoint, sharding
from dspec.training import optimizer as optimizer_lib


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


def train(task: TrainTask, cfg, workdir: str) -> dict:
  """Runs (or resumes) training; returns the last logged and eval metrics.

  cfg: the `training` ConfigDict (num_steps, learning_rate, warmup_ratio, weight_decay,
  grad_clip, b1, b2, seed, log_every, eval_every, ckpt_every, max_minutes; optional
  mesh and sharding_rules: params, optimizer state and the frozen model are then sharded
  (fsdp + tensor, `dspec/sharding.py`) and batches split over the batch axes).

  Resuming: the newest checkpoint under `workdir/checkpoints` restores everything (params,
  optimizer moments, step). Without one, `continue_from_init=True` makes a warm restart
  from the export at `init_from` (which the task loaded into the model): training continues
  at the step recorded in it, the schedule where it was, with fresh optimizer moments.
  `export_every` > 0 also exports the model to `workdir/export` every that many steps.
  """
  os.makedirs(workdir, exist_ok=True)
  optimizer = optimizer_lib.make_optimizer(cfg)
  graphdef, params, rest = nnx.split(task.model, nnx.Param, ...)
  placement = sharding.placement_from_config(cfg, sharding.find_model_config(task.model))
  frozen = task.frozen
  if placement:
    params, rest = placement.put_params(params), placement.put_params(rest)
    frozen = sharding.place_tree(frozen, placement)
  opt_state = placement.init_sharded(optimizer.init, params) if placement else \
      optimizer.init(params)

  ckpt = checkpoint.TrainCheckpointer(os.path.join(workdir, 'checkpoints'),
                                      max_to_keep=2)
  start_step = 0
  latest = ckpt.latest_step()
  if latest is not None:
    restored, _ = ckpt.restore(latest, {'params': params, 'opt_state': opt_state})
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

  def loss_of_params(p, frozen, batch, key):
    return task.loss_fn(nnx.merge(graphdef, p, rest), frozen, batch, key)

  def train_step(p, opt_state, frozen, batch, key):
    (loss, metrics), grads = jax.value_and_grad(loss_of_params, has_aux=True)(
        p, frozen, batch, key)
    updates, opt_state = optimizer.update(grads, opt_state, p)
    p = optax.apply_updates(p, updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
    return p, opt_state, metrics

  if placement:
    train_step = placement.jit(train_step, out_shardings=(
        placement.shardings(placement.param_specs(params)),
        placement.shardings(placement.param_specs(opt_state)), None))
  else:
    train_step = jax.jit(train_step)

  log_path = os.path.join(workdir, 'train_log.jsonl')
  base_key = jax.random.key(cfg.seed)
  t_start = time.time()
  last, evals = {}, {}
  step = start_step
  for step in range(start_step, cfg.num_steps):
    batch = jax.tree.map(jnp.asarray, task.get_batch(step))
    if placement:
      batch = placement.put_batch(batch)
    params, opt_state, metrics = train_step(params, opt_state, frozen, batch,
                                            jax.random.fold_in(base_key, step))
    done = step + 1
    out_of_time = cfg.max_minutes and (time.time() - t_start) > 60 * cfg.max_minutes
    if done % cfg.log_every == 0 or done == cfg.num_steps or out_of_time:
      last = {k: float(v) for k, v in metrics.items()}
      last.update(step=done, elapsed_s=round(time.time() - t_start, 1))
      if task.evaluate is not None and (done % cfg.eval_every == 0 or done == cfg.num_steps
                                        or out_of_time):
        evals = task.evaluate(nnx.merge(graphdef, params, rest), task.frozen)
        last.update({f'eval/{k}': v for k, v in evals.items()})
      logging.info('step %d %s', done, json.dumps(last))
      print(json.dumps(last), flush=True)
      with open(log_path, 'a') as f:
        f.write(json.dumps(last) + '\n')
    if done % cfg.ckpt_every == 0 or done == cfg.num_steps or out_of_time:
      ckpt.save(done, {'params': params, 'opt_state': opt_state}, {'step': done})
    if task.export is not None and cfg.get('export_every') and done % cfg.export_every == 0:
      task.export(nnx.merge(graphdef, params, rest), os.path.join(workdir, 'export'), done)
    if out_of_time:
      logging.warning('stopping at step %d: max_minutes=%s reached', done, cfg.max_minutes)
      break
  ckpt.wait()
  ckpt.close()
  model = nnx.merge(graphdef, params, rest)
  if task.export is not None:
    task.export(model, os.path.join(workdir, 'final'), step + 1)
  return {'last': last, 'eval': evals, 'steps': step + 1 - start_step}
