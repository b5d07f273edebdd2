"""Self-distillation: the target writes continuations for a prompt set (DFlash §4, FastMTP).

Output directory layout (what drafter training reads):
  manifest.json        {"fingerprint", "shards": [names], "complete": bool, counts}
  shard_00000.npz      tokens int32 [N, L] (prompt + continuation, right-padded with 0),
                       loss_mask bool [N, L] (True exactly at target-written tokens),
                       lengths int32 [N]
A shard file appears only once fully written (write to a temp name, then rename), and the
manifest lists a shard only after its file exists, so an interrupted run never leaves a
shard that looks complete; rerunning the same command resumes at the first missing shard.
The manifest also records a SHA-256 of the target's weights and of its tokenizer: a resume
with another model (other weights at the same path, another seed) is refused. One process
at a time may write a directory (a lock refuses a second; one left by a killed run is
stale and taken over). A manifest that lists no shard yet (a run killed before its first
shard) is started afresh whatever its settings. A directory holding anything but a
distilled set is refused unless `force` (nothing in it is deleted).

Across processes (`dspec.distributed`) process i writes the shards s with s % N == i into
the shared directory, each on its own devices; process 0 holds the lock and the manifest
and lists every process's shards once all are written (a killed run redoes the shards it
had not listed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import zipfile

import numpy as np
from flax import nnx
from tqdm import tqdm

from dspec import checkpoint, config_checks, datasets, distributed
from dspec.files import (check_outputs, config_inputs, directory_lock, write_atomic,
                         write_json_atomic)
from dspec.decoding.prompts import generated_ids, pad_prompts
from dspec.decoding.runner import Settings, speculative_engine
from dspec.loading import build_target
from dspec.tokenizer import fingerprint as tokenizer_fingerprint

_MANIFEST = 'manifest.json'
_WIDTH_BUCKET = 64


def _read_manifest(manifest_path: str) -> dict:
  try:
    with open(manifest_path) as f:
      manifest = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f'{manifest_path}: not valid JSON ({e})') from None
  if not isinstance(manifest, dict) or not isinstance(manifest.get('shards'), list):
    raise ValueError(f'{manifest_path}: not a distilled-dataset manifest (no "shards" list)')
  return manifest


def _load_shard(path: str, name: str) -> dict:
  """The arrays of one shard file, read fully (a damaged file raises ValueError)."""
  file = os.path.join(path, name)
  if os.path.isfile(file) and not zipfile.is_zipfile(file):
    raise ValueError(f'{file}: damaged shard (not an .npz archive)')
  try:
    with np.load(file) as data:
      return {k: data[k] for k in ('tokens', 'loss_mask', 'lengths')}
  except FileNotFoundError:
    raise FileNotFoundError(f'{file}: shard listed in {_MANIFEST} is missing') from None
  except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as e:
    raise ValueError(f'{file}: damaged shard ({e})') from None


def load_distilled(path: str, vocab_size: int = 0) -> dict:
  """All listed shards concatenated: dict(tokens, loss_mask, lengths). vocab_size > 0:
  ValueError when a token id is outside the target's vocabulary (data distilled with
  another tokenizer: its embedding lookups would be NaN, and so would every loss)."""
  manifest_path = os.path.join(path, _MANIFEST)
  if not os.path.exists(manifest_path):
    raise FileNotFoundError(f'no distilled dataset at {path} (missing {_MANIFEST}); '
                            'run scripts/distill.py first')
  manifest = _read_manifest(manifest_path)
  if not manifest['shards']:
    raise ValueError(f'distilled dataset {path} has no shards yet')
  parts = [_load_shard(path, name) for name in manifest['shards']]
  width = max(p['tokens'].shape[1] for p in parts)

  def pad(a):
    return np.pad(a, ((0, 0), (0, width - a.shape[1])))

  out = {'tokens': np.concatenate([pad(p['tokens']) for p in parts]),
         'loss_mask': np.concatenate([pad(p['loss_mask']) for p in parts]),
         'lengths': np.concatenate([p['lengths'] for p in parts])}
  top = int(out['tokens'].max(initial=0))
  if vocab_size and (top >= vocab_size or int(out['tokens'].min(initial=0)) < 0):
    raise ValueError(f'distilled dataset {path} holds token id {top}, outside the target\'s '
                     f'vocabulary of {vocab_size}: it was distilled with another tokenizer '
                     f'(distill it again for this target)')
  return out


def _encode_prompts(cfg, tokenizer) -> list:
  dcfg = cfg.distill
  ids = []
  for name, limit in sorted(dcfg.prompt_sets.items()):
    for text in datasets.load_prompts(name, cfg.data_dir, limit):
      row = tokenizer.encode(text)[:dcfg.max_prompt_tokens]
      if row:
        ids.append(row)
  return ids


def _generate_batch(engine, params, rows, cfg, seed):
  """Continuations for a batch of prompts (padded to a width bucket and batch size)."""
  dcfg = cfg.distill
  batch = dcfg.batch_size
  real = len(rows)
  rows = rows + [rows[0]] * (batch - real)
  prompt_BP, lens = pad_prompts(rows, width_multiple=_WIDTH_BUCKET)
  state = engine.prefill(params, None, prompt_BP, lens, temperature=cfg.temperature,
                         top_p=cfg.top_p, max_new_tokens=dcfg.max_new_tokens, seed=seed)
  state = engine.generate(params, None, state)
  return generated_ids(state)[:real]


def _open_manifest(out_dir: str, fingerprint: str, models: dict, num_prompts: int,
                   temperature: float) -> dict:
  """The manifest to resume (checked against the settings and the model) or a new one."""
  manifest_path = os.path.join(out_dir, _MANIFEST)
  if not os.path.exists(manifest_path):
    manifest = dict({'fingerprint': fingerprint, 'shards': [], 'complete': False,
                     'num_prompts': num_prompts, 'temperature': temperature}, **models)
    write_json_atomic(manifest_path, manifest)
    return manifest
  manifest = _read_manifest(manifest_path)
  if not manifest['shards'] and not manifest.get('complete'):   # killed before a shard
    manifest = dict({'fingerprint': fingerprint, 'shards': [], 'complete': False,
                     'num_prompts': num_prompts, 'temperature': temperature}, **models)
    write_json_atomic(manifest_path, manifest)
    return manifest
  if manifest.get('fingerprint') != fingerprint:
    raise ValueError(f'{out_dir} holds a distilled set made with other settings; '
                     'use a new --out_dir')
  for key, value in models.items():
    recorded = manifest.get(key)
    if recorded is None:
      print(f'warning: {manifest_path} has no {key} (written by an older dspec); cannot '
            'check that its shards came from this model; recording it now', file=sys.stderr)
      manifest[key] = value
    elif recorded != value:
      what = 'target weights' if key == 'target_sha256' else 'tokenizer'
      raise ValueError(f'{out_dir} was distilled with other {what} ({key} differs: '
                       f'{recorded[:12]} vs {value[:12]}); use a new --out_dir')
  write_json_atomic(manifest_path, manifest)
  return manifest


def distill(cfg, out_dir: str, force: bool = False) -> dict:
  """Generates (or resumes generating) the distilled dataset; returns the manifest.
  `force`: write into a directory that holds files of something else."""
  dcfg = cfg.distill
  config_checks.check_distill_config(cfg)
  spec = Settings(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                  seed=cfg.seed).sampling()
  if not out_dir:
    raise ValueError('empty --out_dir')
  distributed.on_main(lambda: check_outputs(
      {'--out_dir': out_dir}, config_inputs(cfg), force=force,
      dirs={'--out_dir': lambda d: os.path.exists(os.path.join(d, _MANIFEST))}))
  target, tokenizer, _ = build_target(cfg.model)
  prompts = _encode_prompts(cfg, tokenizer)
  if not prompts:
    raise ValueError('the config\'s distill.prompt_sets give no prompts')
  fingerprint = hashlib.sha256(json.dumps(
      [cfg.model.path, cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed,
       dcfg.max_new_tokens, dcfg.shard_size, prompts], sort_keys=True).encode()).hexdigest()
  models = {'target_sha256': checkpoint.params_sha256(
                nnx.to_pure_dict(nnx.state(target, nnx.Param))),
            'tokenizer_sha256': tokenizer_fingerprint(tokenizer)}
  main = distributed.is_main()
  with directory_lock(out_dir, 'distillation') if main else contextlib.nullcontext():
    manifest = None
    if main:
      manifest = _open_manifest(out_dir, fingerprint, models, len(prompts), cfg.temperature)
    manifest = distributed.broadcast_json(manifest)
    return _distill_shards(cfg, out_dir, manifest, target, tokenizer, prompts, spec)


def _distill_shards(cfg, out_dir, manifest, target, tokenizer, prompts, spec) -> dict:
  """Writes every shard the manifest does not list yet (this process's share of them),
  then marks the set complete."""
  dcfg = cfg.distill
  manifest_path = os.path.join(out_dir, _MANIFEST)
  main, share = distributed.is_main(), distributed.process_share()

  graphdef, params = nnx.split(target)
  engine = speculative_engine(graphdef, None, spec, tokenizer.stop_ids)
  num_shards = -(-len(prompts) // dcfg.shard_size)
  bar = tqdm(total=len(prompts), desc='distill', unit='prompt')
  for s in range(num_shards):
    name = f'shard_{s:05d}.npz'
    shard_prompts = prompts[s * dcfg.shard_size:(s + 1) * dcfg.shard_size]
    if name in manifest['shards'] or not share(s):
      bar.update(len(shard_prompts))
      continue
    order = np.argsort([len(p) for p in shard_prompts], kind='stable')
    outputs = [None] * len(shard_prompts)
    for b in range(0, len(order), dcfg.batch_size):
      idx = order[b:b + dcfg.batch_size]
      gen = _generate_batch(engine, params, [shard_prompts[i] for i in idx], cfg,
                            seed=(cfg.seed + s * 100_003 + b) % 2 ** 31)
      for i, g in zip(idx, gen):
        outputs[i] = g
      bar.update(len(idx))
    width = max(len(p) + len(o) for p, o in zip(shard_prompts, outputs))
    tokens = np.zeros((len(shard_prompts), width), np.int32)
    loss_mask = np.zeros((len(shard_prompts), width), bool)
    for i, (p, o) in enumerate(zip(shard_prompts, outputs)):
      tokens[i, :len(p) + len(o)] = p + o
      loss_mask[i, len(p):len(p) + len(o)] = True
    lengths = np.array([len(p) + len(o) for p, o in zip(shard_prompts, outputs)], np.int32)
    def write_shard(tmp):
      with open(tmp, 'wb') as f:
        np.savez_compressed(f, tokens=tokens, loss_mask=loss_mask, lengths=lengths)

    write_atomic(os.path.join(out_dir, name), write_shard)
    manifest['shards'].append(name)
    if main:
      write_json_atomic(manifest_path, manifest)
  bar.close()
  if distributed.active():   # every process's shards are written: list them all
    distributed.barrier('distilled shards written')
    manifest['shards'] = [f'shard_{s:05d}.npz' for s in range(num_shards)]
  manifest['complete'] = True
  manifest['num_tokens_written'] = int(sum(
      _load_shard(out_dir, n)['loss_mask'].sum() for n in manifest['shards']))
  if main:
    write_json_atomic(manifest_path, manifest)
  return manifest


def fit_rows(a: np.ndarray, width: int) -> np.ndarray:
  """Rows cut or zero-padded to `width` columns."""
  a = a[:, :width]
  return np.pad(a, ((0, 0), (0, width - a.shape[1])))


@dataclasses.dataclass
class DistilledRows:
  """Distilled rows fitted to the training width, split into train rows and held-out rows
  (a set too small to hold any out evaluates on its training rows)."""

  tokens: np.ndarray       # [N, width] int32
  loss_mask: np.ndarray    # [N, width] bool: target-written tokens
  train_rows: np.ndarray   # [num_train] indices of the training rows
  held_tokens: np.ndarray
  held_mask: np.ndarray

  @property
  def num_train(self) -> int:
    return len(self.train_rows)

  def batch(self, step: int, seed: int, batch_size: int) -> dict:
    """The deterministic training batch of `step`: epochs of shuffled train rows, each
    row once per epoch (epoch e is permutation `[seed, e]`), so a resumed run sees exactly
    the rows it would have seen."""
    pos = step * batch_size + np.arange(batch_size)
    epoch, offset = np.divmod(pos, self.num_train)
    rows = np.empty(batch_size, np.int64)
    for e in np.unique(epoch):
      perm = np.random.default_rng([seed, int(e)]).permutation(self.num_train)
      rows[epoch == e] = perm[offset[epoch == e]]
    rows = self.train_rows[rows]
    return {'tokens': self.tokens[rows], 'loss_mask': self.loss_mask[rows]}


def _evenly_spaced(n: int, k: int) -> np.ndarray:
  """k distinct indices spread evenly over range(n) (k <= n)."""
  return np.unique(np.round(np.linspace(0, n - 1, k)).astype(np.int64)) if k else \
      np.zeros(0, np.int64)


def split_distilled(data: dict, width: int, heldout_fraction: float, eval_windows: int,
                    name: str = 'distilled data') -> DistilledRows:
  """`load_distilled` output fitted to `width` and split. The held-out rows are a
  `heldout_fraction` of the rows spread evenly over the whole set, so every prompt set of
  the distillation (code and GSM8K in the demo's) is held out in proportion; at most
  `eval_windows` of them, again spread evenly, are kept for evaluation."""
  tokens = fit_rows(data['tokens'].astype(np.int32), width)
  loss_mask = fit_rows(data['loss_mask'].astype(bool), width)
  n_held = int(round(len(tokens) * heldout_fraction))
  held = _evenly_spaced(len(tokens), n_held)
  train = np.setdiff1d(np.arange(len(tokens)), held)
  if len(train) < 1:
    raise ValueError(f'{name}: {len(tokens)} sequences leave none for training')
  if not len(held):
    held = train
  held = held[_evenly_spaced(len(held), min(eval_windows, len(held)))]
  return DistilledRows(tokens, loss_mask, train, tokens[held], loss_mask[held])
