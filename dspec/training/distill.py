"""Self-distillation: the target writes continuations for a prompt set (DFlash §4, FastMTP).

Output directory layout (what drafter training reads):
  manifest.json        {"fingerprint", "shards": [names], "complete": bool, counts}
  shard_00000.npz      tokens int32 [N, L] (prompt + continuation, right-padded with 0),
                       loss_mask bool [N, L] (True exactly at target-written tokens),
                       lengths int32 [N]
A shard file appears only once fully written (write to a temp name, then rename), and the
manifest lists a shard only after its file exists, so an interrupted run never leaves a
shard that looks complete; rerunning the same command resumes at the first missing shard.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
from flax import nnx
from tqdm import tqdm

from dspec.decoding.engine import SpeculativeEngine
from dspec.files import write_atomic, write_json_atomic
from dspec.decoding.runner import build_target, generated_ids, validate_sampling
from dspec.training import corpus

_MANIFEST = 'manifest.json'
_WIDTH_BUCKET = 64


def load_distilled(path: str) -> dict:
  """All listed shards concatenated: dict(tokens, loss_mask, lengths)."""
  manifest_path = os.path.join(path, _MANIFEST)
  if not os.path.exists(manifest_path):
    raise FileNotFoundError(f'no distilled dataset at {path} (missing {_MANIFEST}); '
                            'run scripts/distill.py first')
  with open(manifest_path) as f:
    manifest = json.load(f)
  if not manifest['shards']:
    raise ValueError(f'distilled dataset {path} has no shards yet')
  parts = [np.load(os.path.join(path, name)) for name in manifest['shards']]
  width = max(p['tokens'].shape[1] for p in parts)

  def pad(a):
    return np.pad(a, ((0, 0), (0, width - a.shape[1])))

  return {'tokens': np.concatenate([pad(p['tokens']) for p in parts]),
          'loss_mask': np.concatenate([pad(p['loss_mask']) for p in parts]),
          'lengths': np.concatenate([p['lengths'] for p in parts])}


def _encode_prompts(cfg, tokenizer) -> list:
  dcfg = cfg.distill
  ids = []
  for name, limit in sorted(dcfg.prompt_sets.items()):
    for text in corpus.load_prompts(name, cfg.data_dir, limit):
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
  width = -(-max(len(r) for r in rows) // _WIDTH_BUCKET) * _WIDTH_BUCKET
  prompt_BP = np.zeros((batch, width), np.int32)
  for i, r in enumerate(rows):
    prompt_BP[i, :len(r)] = r
  lens = np.array([len(r) for r in rows], np.int32)
  state = engine.prefill(params, None, prompt_BP, lens, temperature=cfg.temperature,
                         top_p=cfg.top_p, max_new_tokens=dcfg.max_new_tokens, seed=seed)
  state = engine.generate(params, None, state)
  return generated_ids(state)[:real]


def distill(cfg, out_dir: str) -> dict:
  """Generates (or resumes generating) the distilled dataset; returns the manifest."""
  dcfg = cfg.distill
  spec = validate_sampling(cfg)
  target, tokenizer, _ = build_target(cfg.model)
  prompts = _encode_prompts(cfg, tokenizer)
  fingerprint = hashlib.sha256(json.dumps(
      [cfg.model.path, cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed,
       dcfg.max_new_tokens, dcfg.shard_size, prompts], sort_keys=True).encode()).hexdigest()
  os.makedirs(out_dir, exist_ok=True)
  manifest_path = os.path.join(out_dir, _MANIFEST)
  if os.path.exists(manifest_path):
    with open(manifest_path) as f:
      manifest = json.load(f)
    if manifest['fingerprint'] != fingerprint:
      raise ValueError(f'{out_dir} holds a distilled set made with other settings; '
                       'use a new --out_dir')
  else:
    manifest = {'fingerprint': fingerprint, 'shards': [], 'complete': False,
                'num_prompts': len(prompts), 'temperature': cfg.temperature}
    write_json_atomic(manifest_path, manifest)

  graphdef, params = nnx.split(target)
  engine = SpeculativeEngine(graphdef, sampling=spec, stop_ids=tuple(tokenizer.stop_ids))
  num_shards = -(-len(prompts) // dcfg.shard_size)
  bar = tqdm(total=len(prompts), desc='distill', unit='prompt')
  for s in range(num_shards):
    name = f'shard_{s:05d}.npz'
    shard_prompts = prompts[s * dcfg.shard_size:(s + 1) * dcfg.shard_size]
    if name in manifest['shards']:
      bar.update(len(shard_prompts))
      continue
    order = np.argsort([len(p) for p in shard_prompts], kind='stable')
    outputs = [None] * len(shard_prompts)
    for b in range(0, len(order), dcfg.batch_size):
      idx = order[b:b + dcfg.batch_size]
      gen = _generate_batch(engine, params, [shard_prompts[i] for i in idx], cfg,
                            seed=cfg.seed + s * 100_003 + b)
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
        np.savez(f, tokens=tokens, loss_mask=loss_mask, lengths=lengths)

    write_atomic(os.path.join(out_dir, name), write_shard)
    manifest['shards'].append(name)
    write_json_atomic(manifest_path, manifest)
  bar.close()
  manifest['complete'] = True
  manifest['num_tokens_written'] = int(sum(
      np.load(os.path.join(out_dir, n))['loss_mask'].sum() for n in manifest['shards']))
  write_json_atomic(manifest_path, manifest)
  return manifest
