"""A training sweep: the same base config trained once per variant, results in one table.

A variant is a name and a tuple of (dotted config key, value) overrides. Every variant
trains in `<out_dir>/<name>` through the normal resumable trainer, so an interrupted sweep
resumes where it stopped; its figures are the last evaluated line of that run's
train_log.jsonl. Used for the MTP knob ablation, joint vs post-hoc, and the DFlash vs
BD3-LM objective comparison.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

from dspec.files import LOCK_FILE, write_json_atomic, write_text_atomic

RESULTS_JSON, RESULTS_MD = 'results.json', 'results.md'


def variant_config(base, overrides):
  """A copy of `base` with the dotted-key `overrides` applied (unknown keys are errors)."""
  cfg = base.copy_and_resolve_references()
  for key, value in overrides:
    node = cfg
    *parents, leaf = key.split('.')
    for name in parents:
      if name not in node:
        raise ValueError(f'sweep override {key!r}: the config has no {name!r}')
      node = node[name]
    if leaf not in node:
      raise ValueError(f'sweep override {key!r}: the config has no {leaf!r}')
    node[leaf] = value
  return cfg


def last_eval(workdir: str) -> dict:
  """The last train_log.jsonl line that carries eval/ metrics ({} when none)."""
  path = os.path.join(workdir, 'train_log.jsonl')
  if not os.path.exists(path):
    return {}
  rows = [json.loads(line) for line in open(path) if line.strip()]
  evaluated = [r for r in rows if any(k.startswith('eval/') for k in r)]
  return evaluated[-1] if evaluated else {}


def is_sweep_dir(out_dir: str, variants: Sequence) -> bool:
  """Whether `out_dir` holds only what a sweep of `variants` writes: their workdirs and
  the results table (an earlier run, which this one resumes)."""
  ours = {name for name, _ in variants} | {RESULTS_JSON, RESULTS_MD, LOCK_FILE}
  return set(os.listdir(out_dir)) <= ours


def run_sweep(base, variants: Sequence, out_dir: str, metrics: Sequence[str],
              only: Sequence[str] = ()) -> list:
  """Trains every variant (or those named in `only`); returns one row per variant and
  writes results.json and results.md to `out_dir`."""
  from dspec.training import tasks
  names = [name for name, _ in variants]
  unknown = sorted(set(only) - set(names))
  if unknown:
    raise ValueError(f'unknown sweep variants {unknown}; known: {names}')
  rows = []
  for name, overrides in variants:
    workdir = os.path.join(out_dir, name)
    if not only or name in only:
      tasks.run_training(variant_config(base, overrides), workdir)
    result = last_eval(workdir)
    if result:
      rows.append({'variant': name, 'overrides': [list(o) for o in overrides],
                   'step': result.get('step'), 'elapsed_s': result.get('elapsed_s'),
                   **{m: result.get(f'eval/{m}') for m in metrics}})
  write_json_atomic(os.path.join(out_dir, RESULTS_JSON), rows)
  write_text_atomic(os.path.join(out_dir, RESULTS_MD), markdown_table(rows, metrics))
  return rows


def markdown_table(rows: Sequence[dict], metrics: Sequence[str]) -> str:
  head = ['variant', 'overrides', 'steps'] + list(metrics)
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for r in rows:
    overrides = ', '.join(f'{k}={v}' for k, v in r['overrides']) or '(base)'
    cells = [r['variant'], overrides, str(r['step'])]
    cells += ['—' if r[m] is None else f'{r[m]:.3f}' for m in metrics]
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines) + '\n'
