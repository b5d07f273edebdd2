"""Held-out teacher-forced per-slot acceptance and τ estimates of a learned drafter.

  python scripts/eval_drafter.py --kind=dflash2 --path=demo/dflash2 \
      [--target=demo/target] [--data=demo/distill_demo8k] [--rows=64] \
      [--out=runs/eval/dflash2.json] [--force]
  python scripts/eval_drafter.py --kind=dflash2 --path=demo/dflash2 --prompts=4

--kind is a learned kind with a slot reader (`slot_acceptance.KINDS`: dflash, dflash2,
dspark, eagle3, mtp); --path a checkpoint of that family (dspec or a published form dspec
reads). The rows are the held-out rows of the training split (`distill.split_distilled`
with the drafter configs' width and held-out fraction: spread over the whole
distillation, so over its code and GSM8K prompts), at most --rows of them; with
--prompts=N instead the first N prompts of HumanEval and of GSM8K test (`data/`, as
`bench_trees.py` decodes them) and the target's greedy continuations of
--max_new_tokens (the benchmark's distribution, not the training one). At every
decode anchor of a row the drafter drafts its K slots as it does at T = 0
(`dspec.training.slot_acceptance`); the table gives per slot p(hit | earlier slots hit),
p(slots 1..k hit) and p(hit), then two τ estimates at fixed verification of the K drafts:
`tau`, 1 + E[accepted drafts] over all anchors alike, and `walk tau`, the tokens per step
a T = 0 decode of the rows' prompts commits (what decoding measures). --out writes the
table as JSON (atomically); an existing file dspec did not write is kept unless --force,
and an --out inside --path, --target or --data is refused. Bad input prints one `error:
...` line and exits with status 1.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from dspec import cli, console  # noqa: E402
from dspec.errors import UserError  # noqa: E402
from dspec.models.formats import DRAFTERS  # noqa: E402
from dspec.training.slot_acceptance import KINDS, kind_of  # noqa: E402

WIDTH = 320               # configs/common.py drafter_training: seq_len
HELDOUT_FRACTION = 0.03   # ... and data.heldout_fraction

_KIND = flags.DEFINE_enum('kind', None, list(KINDS), 'Drafter family.', required=True)
_PATH = flags.DEFINE_string('path', None, 'Drafter checkpoint.', required=True)
_TARGET = flags.DEFINE_string('target', 'demo/target', 'The target (dspec checkpoint or '
                              'Hugging Face directory).')
_DATA = flags.DEFINE_string('data', 'demo/distill_demo8k', 'Distilled dataset '
                            '(scripts/distill.py) whose held-out rows are evaluated.')
_ROWS = flags.DEFINE_integer('rows', 64, 'Most held-out rows to evaluate.')
_PROMPTS = flags.DEFINE_integer('prompts', 0, 'Rows from this many HumanEval and GSM8K '
                                'test prompts each and the target\'s greedy continuations '
                                '(0: held-out rows of --data).', lower_bound=0)
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 64, 'Continuation length (--prompts).',
                                lower_bound=1)
_OUT = flags.DEFINE_string('out', '', 'JSON file to write (optional).')
_FORCE = flags.DEFINE_boolean('force', False, 'Replace an --out file dspec did not write.')


def _load(kind: str, path: str, target):
  drafter = DRAFTERS[kind].load(path, target_cfg=target.cfg)
  if kind_of(drafter) != kind:
    raise UserError(f'--path={path} holds a {kind_of(drafter)} drafter, not {kind} '
                    f'(pass --kind={kind_of(drafter)})')
  return drafter


def _greedy_rows(target, tokenizer, num_prompts: int, max_new_tokens: int):
  """(tokens [R, S], loss mask [R, S]): each prompt of HumanEval and GSM8K test and the
  target's T = 0 continuation, the mask on the continuation."""
  import numpy as np
  from flax import nnx
  from dspec import datasets
  from dspec.decoding import runner
  from dspec.decoding.prompts import generated_ids, pad_prompts
  prompts = [tokenizer.encode(p) for name in ('humaneval', 'gsm8k_test')
             for p in datasets.load_prompts(name, 'data', num_prompts)]
  graphdef, params = nnx.split(target)
  ar = runner.speculative_engine(graphdef, stop_ids=tokenizer.stop_ids)
  state = ar.generate(params, None, ar.prefill(params, None, *pad_prompts(prompts),
                                               max_new_tokens=max_new_tokens))
  rows = [p + g for p, g in zip(prompts, generated_ids(state))]
  width = max(map(len, rows))
  tokens_RS = np.zeros((len(rows), width), np.int32)
  mask_RS = np.zeros((len(rows), width), bool)
  for r, (p, row) in enumerate(zip(prompts, rows)):
    tokens_RS[r, :len(row)] = row
    mask_RS[r, len(p):len(row)] = True
  return tokens_RS, mask_RS


def main(argv):
  del argv
  console.configure()
  from dspec import checkpoint, files, loading
  from dspec.training import slot_acceptance
  from dspec.training.distill import load_distilled, split_distilled
  from configs import common

  if _ROWS.value < 1:
    raise UserError(f'--rows must be >= 1, got {_ROWS.value}')
  inputs = {'--path': _PATH.value, '--target': _TARGET.value, '--data': _DATA.value}
  files.check_outputs({'--out': _OUT.value or None}, inputs, force=_FORCE.value)
  if not os.path.isdir(_PATH.value):
    raise UserError(f'--path={_PATH.value}: no such directory')
  model_cfg = common.model_config('demo')
  model_cfg.source = loading.target_source(_TARGET.value)
  model_cfg.path = _TARGET.value
  target, tokenizer, _ = loading.build_target(model_cfg)
  drafter = _load(_KIND.value, _PATH.value, target)
  mismatch = checkpoint.check_target_record(_PATH.value, target)
  if mismatch:
    print(f'warning: {mismatch}', file=sys.stderr, flush=True)
  if _PROMPTS.value:
    tokens_RS, mask_RS = _greedy_rows(target, tokenizer, _PROMPTS.value, _MAX_NEW.value)
    source = f'{_PROMPTS.value} HumanEval + {_PROMPTS.value} GSM8K test prompts'
  else:
    rows = split_distilled(load_distilled(_DATA.value), WIDTH, HELDOUT_FRACTION,
                           _ROWS.value, _DATA.value)
    tokens_RS, mask_RS = rows.held_tokens, rows.held_mask
    source = f'held-out rows of {_DATA.value}'
  table = slot_acceptance.slot_table(drafter, target, tokens_RS, mask_RS)

  print(f'{_KIND.value} {_PATH.value}: {len(tokens_RS)} {source}, '
        f'{table.num_anchors} anchors, K = {table.num_slots}')
  print(f'{"slot":>4} {"p(hit|prev)":>11} {"p(1..k)":>8} {"p(hit)":>7} {"reached":>8}')
  for k in range(table.num_slots):
    print(f'{k + 1:>4} {table.conditional[k]:>11.3f} {table.start_hit[k]:>8.3f} '
          f'{table.marginal[k]:>7.3f} {int(table.reached_K[k]):>8}')
  print(f'tau (all anchors) = {table.tau:.3f}   walk tau (decode of the rows) = '
        f'{table.walk_tau:.3f} over {table.walk_steps} steps')
  if _OUT.value:
    files.write_json_atomic(_OUT.value, files.mark({
        'kind': _KIND.value, 'path': _PATH.value, 'target': _TARGET.value,
        'data': source, 'rows': len(tokens_RS), **table.to_dict()},
        'eval_drafter'))
    print(f'wrote {_OUT.value}')


if __name__ == '__main__':
  cli.run(main)
