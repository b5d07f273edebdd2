"""Tree vs chain: τ of tree verification against fixed verification of the same drafter.

  python scripts/bench_trees.py --drafters=eagle3:demo/eagle3,dflash2:demo/dflash2 \
      --shapes=32x4,32x8 [--num_prompts=4] [--max_new_tokens=64] [--out=trees.json]

Each drafter (kind:checkpoint; `dflash2` is the dflash drafter on a DFlash-2 checkpoint)
decodes the first --num_prompts prompts of HumanEval and of GSM8K test at T = 0 and T = 1,
once with fixed verification (the chain of num_draft drafts) and once per tree shape
NODESxTOP_K (`--config.tree.num_nodes / top_k`). τ is committed tokens per verify step,
pooled over the prompts (one batch; rows are independent, so τ is that of B = 1).
Expected: one JSON line per drafter and temperature, e.g.
  {"drafter": "eagle3", "T": 0.0, "chain_tau": 2.19, "chain_slot_acceptance": [0.50, ...],
   "trees": {"32x8": {"tau": 2.90, "gain": 1.32, "nodes_verified_per_step": 30.7}}}
(chain_slot_acceptance: p(draft k accepted | drafts < k accepted) of the chain.)
and with --out all of them in one JSON file.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from dspec import cli, files  # noqa: E402
from dspec.errors import UserError  # noqa: E402

_DRAFTERS = flags.DEFINE_list('drafters', ['eagle3:demo/eagle3'], 'kind:checkpoint, ...')
_SHAPES = flags.DEFINE_list('shapes', ['32x4'], 'Tree shapes NODESxTOP_K.')
_TARGET = flags.DEFINE_string('target', 'demo/target', 'The target checkpoint.')
_NUM_PROMPTS = flags.DEFINE_integer('num_prompts', 4, 'Prompts per dataset.', lower_bound=1)
_MAX_NEW_TOKENS = flags.DEFINE_integer('max_new_tokens', 64, 'Tokens per prompt.',
                                       lower_bound=1)
_OUT = flags.DEFINE_string('out', None, 'Where to write the rows (JSON).')
_FORCE = flags.DEFINE_bool('force', False, 'Replace an --out file that dspec did not write.')
DATASETS = ('humaneval', 'gsm8k_test')
DATA_DIR = 'data'   # where the prompt sets are (relative: cwd, then the project root)


def _shape(text: str):
  try:
    nodes, top_k = (int(x) for x in text.split('x'))
  except ValueError:
    raise UserError(f'--shapes: {text!r} is not NODESxTOP_K (e.g. 32x4)') from None
  return nodes, top_k


def main(argv):
  del argv
  shapes = [_shape(s) for s in _SHAPES.value]
  drafters = []
  for spec in _DRAFTERS.value:
    kind, _, path = spec.partition(':')
    if not path:
      raise UserError(f'--drafters: {spec!r} is not kind:checkpoint')
    drafters.append((kind, path))
  files.check_outputs({'--out': _OUT.value}, {
      '--target': _TARGET.value, 'prompt folder': DATA_DIR,
      **{f'--drafters={kind}': path for kind, path in drafters}}, force=_FORCE.value)
  import dspec
  from dspec import datasets
  from dspec.decoding import runner
  from dspec.decoding.tree_engine import TreeConfig
  trees = [TreeConfig(num_nodes=nodes, top_k=top_k)   # each checked before anything loads
           for nodes, top_k in shapes]
  target = dspec.load_target(_TARGET.value)
  prompts = [p for name in DATASETS
             for p in datasets.load_prompts(name, DATA_DIR, _NUM_PROMPTS.value)]
  rows = []
  for kind, path in drafters:
    drafter = dspec.load_drafter('dflash' if kind == 'dflash2' else kind, path, target=target)
    for temperature in (0.0, 1.0):
      settings = runner.Settings(max_new_tokens=_MAX_NEW_TOKENS.value, temperature=temperature)

      def decode(verify_length, tree=TreeConfig()):
        return runner.decode(target, prompts, drafter.drafter, drafter.params,
                             settings=settings, verify_length=verify_length,
                             tree=tree)['metrics']

      chain = decode('fixed')
      chain_tau = chain['tau']
      row = {'drafter': kind, 'path': path, 'T': temperature, 'chain_tau': chain_tau,
             'chain_slot_acceptance': chain['per_position_acceptance_conditional'],
             'trees': {}}
      for tree in trees:
        m = decode('tree', tree)
        row['trees'][f'{tree.num_nodes}x{tree.top_k}'] = {
            'tau': m['tau'], 'gain': m['tau'] / chain_tau,
            'nodes_verified_per_step': m['nodes_verified_per_step']}
      print(json.dumps(row), flush=True)
      rows.append(row)
  if _OUT.value:
    files.write_json_atomic(_OUT.value, files.mark(
        {'prompts': {d: _NUM_PROMPTS.value for d in DATASETS},
         'max_new_tokens': _MAX_NEW_TOKENS.value, 'rows': rows}, 'bench_trees'))


if __name__ == '__main__':
  cli.run(main)
