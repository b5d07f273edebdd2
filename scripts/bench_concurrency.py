"""Throughput and speedup vs concurrency: AR, drafters at fixed γ, and the γ controller.

  python scripts/bench_concurrency.py --config=configs/tiny.py --out_dir=runs/bench_conc
  python scripts/bench_concurrency.py --config=configs/demo.py --out_dir=runs/bench_conc \
      --drafter=ngram,mtp,dflash --concurrency=1,2,4,8,16,32,64 --gammas=3,7
  ... --drafter=oracle --oracle_acceptance=0.3    # a synthetic low-acceptance drafter
  ... --config.temperature=1.0 --config.top_p=0.95  # sampled (lossless not checked)

Every concurrency B decodes the first B prompts of --prompt_set (cycled) as one static
batch, `max_new_tokens` each, with AR and, for every drafter of --drafter (any registered
one, built from the decode config: `drafters.<name>`, e.g. the checkpoint path of a learned
drafter), that drafter at each fixed γ of --gammas (built with `drafters.<name>.num_draft`
= γ; a γ the drafter refuses, e.g. beyond a learned drafter's trained block, is skipped with
a note) and at its configured num_draft under the load-aware controller, whose tiers are
--tiers capped at that num_draft (as `runner.speculative_engine` builds it;
`dspec/decoding/controller.py`; step costs profiled during the warm-up run, or read from
--cost_table); host-side drafters (suffix) too, with host-proposed steps as the positive
tiers. All drafters share one AR baseline per B. Times are medians of `timing_repeats` rounds after a warm-up (compile and profiling
excluded; every round's time is kept as `decode_s_rounds`), every method interleaved within
each round. Speedup = tokens/s over AR's tokens/s (at T = 0 outputs equal AR's, so this is
the decode-time ratio). `lossless` (greedy output == AR) is checked when greedy (T = 0),
null otherwise. Writes concurrency.json (rows), concurrency.md (table + goal checks per
drafter) and concurrency.png.
Goals, per drafter: controller ≥ 0.98× AR at every B; at B=1 within 5% of the best fixed γ.
"""

import copy
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from dspec import cli  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/tiny.py', 'Decode config.',
                                          lock_config=True)
_OUT = flags.DEFINE_string('out_dir', 'runs/bench_concurrency', 'Output directory.')
_CONC = flags.DEFINE_list('concurrency', ['1', '2', '4', '8', '16', '32', '64'],
                          'Batch sizes (concurrent requests).')
_DRAFTERS = flags.DEFINE_list('drafter', ['ngram'], 'Drafters (registry names), e.g. '
                              'ngram,mtp,dflash; each is built from drafters.<name>.')
_GAMMAS = flags.DEFINE_list('gammas', ['3', '7'], 'Fixed draft lengths γ (rows a drafter '
                            'refuses are skipped).')
_TIERS = flags.DEFINE_list('tiers', ['0', '1', '3', '7', '15'],
                           "Controller tiers, capped at each drafter's num_draft.")
_PROMPT_SET = flags.DEFINE_string('prompt_set', 'humaneval', 'Prompt set (corpus.py).')
_MAX_PROMPT = flags.DEFINE_integer('max_prompt_tokens', 64, 'Prompts cut to their last N.')
_ORACLE_ACC = flags.DEFINE_list('oracle_acceptance', None, 'Oracle conditional acceptance '
                                'per position (sets drafters.oracle.acceptance).')
_OBJECTIVE = flags.DEFINE_enum(
    'objective', 'makespan', ['makespan', 'throughput'],
    "Controller objective. Every row here is one static batch, whose throughput is total "
    "tokens / time until its last row ends, so 'makespan' is the matching objective; "
    "'throughput' (committed tokens/s now) is the one for continuous batching.")
_COSTS = flags.DEFINE_string('cost_table', None, 'Step-cost JSON to load (if it exists) '
                             "and to save the profiled costs to; '{drafter}' in the path is "
                             'replaced by the drafter name (needed with several drafters).')
_FORCE = flags.DEFINE_bool('force', False, 'Write into an --out_dir holding files dspec '
                           'did not write (nothing in it is deleted), and replace a '
                           '--cost_table file that is not a step-cost table.')


def _ints(name: str, values, low: int) -> list:
  try:
    out = [int(v) for v in values]
  except ValueError:
    raise cli.UserError(f'--{name} takes integers, got {",".join(values)}') from None
  if not out or min(out) < low:
    raise cli.UserError(f'--{name} needs integers >= {low}, got {",".join(values)}')
  return out


def _check_flags():
  """(drafter names, concurrencies, fixed γs, tiers) or UserError (one line)."""
  from dspec.decoding.drafters import registry
  names = list(dict.fromkeys(_DRAFTERS.value))
  known = [k for k in registry.known() if k != 'none']
  for name in names:
    if name not in known:
      raise cli.UserError(f'unknown drafter {name!r}; known: {", ".join(known)}')
  if not names:
    raise cli.UserError('--drafter is empty')
  conc = _ints('concurrency', _CONC.value, 1)
  if _COSTS.value and len(names) > 1 and '{drafter}' not in _COSTS.value:
    raise cli.UserError("--cost_table with several drafters needs '{drafter}' in the path")
  return (names, sorted(set(conc)), sorted(set(_ints('gammas', _GAMMAS.value, 1))),
          _ints('tiers', _TIERS.value, 0))


def _is_cost_table(path: str) -> bool:
  """An earlier --cost_table (a file `CostTable.load` reads): replaced without --force."""
  from dspec.decoding.controller import CostTable
  try:
    CostTable.load(path)
  except ValueError:
    return False
  return True


def _is_concurrency_dir(out_dir: str) -> bool:
  """An earlier --out_dir: its concurrency.json carries dspec's mark."""
  from dspec import files
  return files.written_by_dspec(os.path.join(out_dir, 'concurrency.json'))


def _drafter_config(cfg, name: str, num_draft=None):
  """A copy of `cfg` building drafter `name` (with `num_draft` when given)."""
  c = copy.deepcopy(cfg)
  c.drafter = name
  if num_draft is not None:
    c.drafters[name].num_draft = num_draft
  return c


def _prompts(cfg, tokenizer, n: int) -> list:
  from dspec.datasets import load_prompts
  texts = load_prompts(_PROMPT_SET.value, cfg.data_dir)
  ids = [tokenizer.encode(t)[-_MAX_PROMPT.value:] for t in texts if t]
  return [ids[i % len(ids)] for i in range(n)]


def _plot(rows, path):
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4))
  for method in dict.fromkeys(r['method'] for r in rows):
    pts = [r for r in rows if r['method'] == method]
    xs = [r['concurrency'] for r in pts]
    style = ':' if pts[0]['verify_length'] == 'fixed' and method != 'ar' else '-'
    ax_t.plot(xs, [r['tokens_per_s'] for r in pts], marker='o', ls=style, label=method)
    ax_s.plot(xs, [r['speedup'] for r in pts], marker='o', ls=style, label=method)
  for ax, label in ((ax_t, 'throughput (tokens/s)'), (ax_s, 'speedup vs AR')):
    ax.set_xscale('log', base=2)
    ax.set_xlabel('concurrency (batch size)')
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  ax_s.axhline(1.0, color='k', lw=0.8)
  ax_t.set_yscale('log')
  ax_s.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120, format='png')


def _goals(rows, drafters) -> dict:
  """Per drafter: controller / AR at every B (minimum) and controller / best fixed γ (or
  AR) at the smallest B."""
  by = {(r['method'], r['concurrency']): r for r in rows}
  conc = sorted({r['concurrency'] for r in rows})
  b1, goals = conc[0], {}
  for name in drafters:
    auto = f'{name} controller'
    fixed = [r['method'] for r in rows if r['drafter'] == name and r['concurrency'] == b1
             and r['verify_length'] == 'fixed']
    g = {'controller_vs_ar_min': min(by[auto, b]['speedup'] for b in conc),
         'smallest_concurrency': b1,
         'controller_vs_best_fixed_b1': by[auto, b1]['tokens_per_s'] / max(
             by[m, b1]['tokens_per_s'] for m in fixed + ['ar'])}
    g['controller_vs_ar_ok'] = g['controller_vs_ar_min'] >= 0.98
    g['controller_vs_best_fixed_b1_ok'] = g['controller_vs_best_fixed_b1'] >= 0.95
    goals[name] = g
  return goals


def _markdown(rows, goals, skipped) -> str:
  methods = list(dict.fromkeys(r['method'] for r in rows))
  conc = sorted({r['concurrency'] for r in rows})
  cell = {(r['method'], r['concurrency']): r for r in rows}
  lines = ['| method | ' + ' | '.join(f'B={b}' for b in conc) + ' |',
           '|---|' + '---|' * len(conc)]
  for m in methods:
    lines.append(f'| {m} | ' + ' | '.join(
        f"{cell[m, b]['tokens_per_s']:.0f} tok/s ({cell[m, b]['speedup']:.2f}×)"
        for b in conc) + ' |')
  lines += ['', 'Positions verified per committed token (1.0 for AR):', '',
            '| method | ' + ' | '.join(f'B={b}' for b in conc) + ' |',
            '|---|' + '---|' * len(conc)]
  for m in methods:
    lines.append(f'| {m} | ' + ' | '.join(
        f"{cell[m, b]['verified_per_committed']:.2f}" for b in conc) + ' |')
  lines.append('')
  for name, g in goals.items():
    lines += [f"{name}: controller / AR, minimum over B: {g['controller_vs_ar_min']:.3f} "
              f"(goal ≥ 0.98: {'met' if g['controller_vs_ar_ok'] else 'NOT met'}); "
              f"controller / best fixed γ at B={g['smallest_concurrency']}: "
              f"{g['controller_vs_best_fixed_b1']:.3f} "
              f"(goal ≥ 0.95: {'met' if g['controller_vs_best_fixed_b1_ok'] else 'NOT met'})"]
  for method, reason in skipped.items():
    lines.append(f'skipped {method}: {reason}')
  checked = [r['lossless'] for r in rows if r['lossless'] is not None]
  lines.append('lossless (greedy output == AR) for every row: '
               f'{all(checked)}' if checked else 'lossless: not checked at T > 0')
  return '\n'.join(lines) + '\n'


def main(argv):
  del argv
  import jax
  from flax import nnx
  from dspec import files, loading
  from dspec.decoding import drafter as drafter_lib
  from dspec.decoding import runner
  from dspec.decoding.controller import ControllerConfig, CostTable
  from dspec.decoding.drafters import registry
  from dspec.decoding.prompts import encode_prompts, generated_ids, pad_prompts
  from dspec.metrics import acceptance_metrics

  names, concurrency, gammas, tier_flag = _check_flags()
  cfg = _CONFIG.value
  if _ORACLE_ACC.value:
    cfg.drafters.oracle.acceptance = [float(a) for a in _ORACLE_ACC.value]
  costs = {f'--cost_table[{name}]': _COSTS.value.replace('{drafter}', name)
           for name in names if _COSTS.value}
  files.check_outputs({'--out_dir': _OUT.value, **costs}, files.config_inputs(cfg),
                      force=_FORCE.value, dirs={'--out_dir': _is_concurrency_dir},
                      ours=dict.fromkeys(costs, _is_cost_table))
  settings = runner.Settings.from_config(cfg)
  spec = settings.sampling()
  target, tokenizer, max_seq_len = loading.build_target(cfg.model)
  graphdef, params = nnx.split(target)
  stop_ids = tuple(tokenizer.stop_ids)
  engine = lambda d: runner.speculative_engine(graphdef, d, spec, stop_ids, verify_length='fixed')

  # method -> (engine or controller, drafter params, host drafter?)
  methods = {'ar': (engine(drafter_lib.NoDrafter()), None, None)}
  info = {'ar': {'drafter': None, 'verify_length': 'fixed', 'num_draft': 0}}
  controllers, skipped, tiers_of = {}, {}, {}
  for name in names:
    drafter, dparams = registry.build_drafter(_drafter_config(cfg, name), target)
    host = isinstance(drafter, drafter_lib.HostProposing)
    for g in gammas:
      try:
        fixed, fparams = registry.build_drafter(_drafter_config(cfg, name, g), target)
      except ValueError as e:
        skipped[f'{name} γ={g}'] = str(e)
        print(f'skipping {name} γ={g}: {e}', flush=True)
        continue
      methods[f'{name} γ={g}'] = (engine(fixed), fparams, host)
      info[f'{name} γ={g}'] = {'drafter': name, 'verify_length': 'fixed', 'num_draft': g}
    gamma, auto = drafter.num_draft, f'{name} controller'
    tiers_of[name] = tuple(sorted({g for g in tier_flag if g < gamma} | {gamma, 0}))
    path = _COSTS.value and _COSTS.value.replace('{drafter}', name)
    costs = CostTable.load(path) if path and os.path.exists(path) else CostTable()
    controllers[name] = (runner.speculative_engine(
        graphdef, drafter, spec, stop_ids, cost_table=costs,
        controller=ControllerConfig(tiers=tiers_of[name], objective=_OBJECTIVE.value)), path)
    methods[auto] = (controllers[name][0], dparams, host)
    info[auto] = {'drafter': name, 'verify_length': 'auto', 'num_draft': gamma}

  rows = []
  for b in concurrency:
    prompt_BP, lens_B = pad_prompts(encode_prompts(
        _prompts(cfg, tokenizer, b), tokenizer, target.cfg.vocab_size, max_seq_len,
        cfg.max_new_tokens))
    # A private suffix cache per method and B: no run drafts from its own earlier answers.
    for e, _, host in methods.values():
      if host:
        e.host.use_factory(
            drafter_lib.host_drafter_factory(e.drafter, private=True))
    # Warm-up (compile; the controllers profile), then timed rounds with the methods
    # interleaved so that load drift on a shared machine hits them alike.
    timed = dict(zip(methods, runner.timed_generations(
        [runner.Generation(e, params, dparams) for e, dparams, _ in methods.values()],
        prompt_BP, lens_B, settings)))
    ar_ids = generated_ids(timed['ar']['state'])
    block = []
    for m, (e, *_rest) in methods.items():
      t, state = timed[m], timed[m]['state']
      row = {'method': m, 'concurrency': b, **info[m], 'tokens_per_s': t['tokens_per_s'],
             'decode_s': t['decode_s'], 'decode_s_rounds': t['decode_s_rounds'],
             'new_tokens': t['new_tokens'],
             **{k: acceptance_metrics(state.stats)[k]
                for k in ('tau', 'verified_per_committed')},
             'lossless': generated_ids(state) == ar_ids if spec.greedy else None}
      if e.adaptive:
        row['tier_usage'] = {str(g): round(f, 3) for g, f in e.tier_usage().items()}
        row['step_costs_ms'] = {str(g): round(1e3 * e.costs[b, g], 3) for g in e.tiers}
      block.append(row)
    for row in block:
      row['speedup'] = row['tokens_per_s'] / block[0]['tokens_per_s']
      print(json.dumps(row), flush=True)
    rows += block
    jax.clear_caches()

  goals = _goals(rows, names)
  out = {'rows': rows, 'goals': goals, 'skipped': skipped, 'device': str(jax.devices()[0]),
         'drafters': names, 'objective': _OBJECTIVE.value, 'tiers': tiers_of,
         'max_new_tokens': cfg.max_new_tokens, 'temperature': settings.temperature,
         'top_p': settings.top_p, 'timing_repeats': cfg.timing_repeats,
         'model': target.cfg.to_dict()}
  files.write_json_atomic(os.path.join(_OUT.value, 'concurrency.json'),
                          files.mark(out, 'bench_concurrency'))
  text = _markdown(rows, goals, skipped)
  files.write_text_atomic(os.path.join(_OUT.value, 'concurrency.md'), text)
  files.write_atomic(os.path.join(_OUT.value, 'concurrency.png'),
                     lambda tmp: _plot(rows, tmp))
  for controller, path in controllers.values():
    if path:
      controller.costs.save(path)
  print(text)


if __name__ == '__main__':
  cli.run(main)
