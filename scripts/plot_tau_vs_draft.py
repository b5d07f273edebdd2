"""The drafter family on the seeds' axis: τ against draft time per verify step.

  python scripts/plot_tau_vs_draft.py --trees=trees.json \
      --costs=cost_mtp.json,cost_eagle3.json,... [--wide_ar=cost_wide.json] \
      --out=docs/results/tau_vs_draft/tau_vs_draft.png [--table=.../results.md]

--trees is a `scripts/bench_trees.py` output (chain τ, per-slot acceptance and tree τ per
drafter checkpoint, T = 0 and 1); --costs are `scripts/bench_draft_cost.py --out` files,
one per drafter checkpoint, on the small target (`configs/demo.py:small`), with
--verify_curve so they hold the AR step; --wide_ar one such file on the wide target
(`configs/demo.py`), whose AR step prices every draft pass there (a drafter's pass costs
the same on both: widening leaves the residual stream, taps and head alone). Rows are
matched by checkpoint path. Expected: the PNG (τ at T = 0
against the draft pass in ms, one point per drafter, labelled) and a markdown table with
τ, tree τ, the first five slots' conditional acceptance, the draft pass in ms and in AR
steps of each target.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from dspec import cli, files  # noqa: E402
from dspec.errors import UserError  # noqa: E402

_TREES = flags.DEFINE_string('trees', None, 'bench_trees.py JSON.', required=True)
_COSTS = flags.DEFINE_list('costs', [], 'bench_draft_cost.py JSONs (small target).')
_WIDE = flags.DEFINE_string('wide_ar', None, 'A bench_draft_cost.py JSON on the wide target '
                            '(with --verify_curve): its AR step.')
_OUT = flags.DEFINE_string('out', None, 'The PNG to write.', required=True)
_TABLE = flags.DEFINE_string('table', None, 'Also write the markdown table there.')
_FORCE = flags.DEFINE_bool('force', False, 'Replace outputs that dspec did not write.')


def _read(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise UserError(f'{path}: not a readable JSON file ({e})') from None


def _by_path(paths) -> dict:
  out = {}
  for path in paths:
    cost = _read(path)
    if 'propose_s' not in cost or 'path' not in cost:
      raise UserError(f'{path}: not a bench_draft_cost.py output')
    out[cost['path']] = cost
  return out


def _draft_s(cost: dict) -> float:
  return cost['propose_s'] + cost['update_s']


def _ar_step_s(cost: dict) -> float:
  if 'verify_curve' not in cost:
    raise UserError(f'{cost["path"]}: its bench_draft_cost.py run had no --verify_curve')
  return cost['verify_curve']['seconds']['1']


def _in_ar_steps(cost, ar_step_s) -> str:
  return f'{_draft_s(cost) / ar_step_s:.2f}' if cost and ar_step_s else '–'


def main(argv):
  del argv
  files.check_outputs({'--out': _OUT.value, '--table': _TABLE.value},
                      {'--trees': _TREES.value, '--wide_ar': _WIDE.value or ''},
                      force=_FORCE.value)
  trees = _read(_TREES.value)
  if 'rows' not in trees:
    raise UserError(f'{_TREES.value}: not a bench_trees.py output')
  costs = _by_path(_COSTS.value)
  wide_ar_s = _ar_step_s(next(iter(_by_path([_WIDE.value]).values()))) if _WIDE.value else 0
  lines = ['| drafter | checkpoint | τ chain, T=0 | τ tree 32, T=0 | τ chain, T=1 | '
           'slots 1–5: acceptance given the earlier ones | draft pass ms | AR steps, small | '
           'AR steps, wide |', '|---|---|---|---|---|---|---|---|---|']
  points = []
  for row in [r for r in trees['rows'] if r['T'] == 0.0]:
    hot = [r for r in trees['rows'] if r['path'] == row['path'] and r['T'] == 1.0]
    tree = next(iter(row['trees'].values()), {})
    slots = ' '.join(f'{a:.2f}' for a in row.get('chain_slot_acceptance', [])[:5])
    cost = costs.get(row['path'])
    ms = f'{1e3 * _draft_s(cost):.2f}' if cost else '–'
    lines.append(f'| {row["drafter"]} | `{row["path"]}` | {row["chain_tau"]:.2f} | '
                 f'{tree.get("tau", float("nan")):.2f} | '
                 f'{hot[0]["chain_tau"]:.2f} | {slots} | {ms} | '
                 f'{_in_ar_steps(cost, cost and _ar_step_s(cost))} | '
                 f'{_in_ar_steps(cost, wide_ar_s)} |' if hot else '')
    if cost:
      points.append((1e3 * _draft_s(cost), row['chain_tau'], row['drafter'], row['path']))
  table = '\n'.join(line for line in lines if line) + '\n'
  print(table, end='')

  import matplotlib
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt
  fig, ax = plt.subplots(figsize=(6.4, 4.4))
  for ms, tau, kind, path in points:
    ax.scatter(ms, tau)
    ax.annotate(f'{kind} ({os.path.basename(path.rstrip("/"))})', (ms, tau),
                textcoords='offset points', xytext=(5, 4), fontsize=8)
  ax.set_xlabel('draft pass per verify step (ms, B = 1, this CPU)')
  ax.set_ylabel('τ, fixed verification, T = 0')
  ax.set_title('τ against draft time (4 HumanEval + 4 GSM8K prompts)')
  ax.grid(alpha=0.3)
  fig.tight_layout()

  def save_png(tmp):
    fig.savefig(tmp, format='png', dpi=120)
  files.write_atomic(_OUT.value, save_png)
  if _TABLE.value:
    def save_table(tmp):
      with open(tmp, 'w') as f:
        f.write(table)
    files.write_atomic(_TABLE.value, save_table)
  print(f'wrote {_OUT.value}')


if __name__ == '__main__':
  cli.run(main)
