"""Throughput and speedup vs concurrency: AR, a drafter at fixed γ, and the γ controller.

  python scripts/bench_concurrency.py --config=configs/tiny.py --out_dir=runs/bench_conc
  python scripts/bench_concurrency.py --config=configs/demo.py --out_dir=runs/bench_conc \
      --concurrency=1,2,4,8,16,32,64 --gammas=3,7 --tiers=0,1,3,7,15
  ... --drafter=oracle --oracle_acceptance=0.3    # a synthetic low-acceptance drafter

Every concurrency B decodes the first B prompts of --prompt_set (cycled) as one static
batch, greedy, `max_new_tokens` each, with AR, the drafter (`ngram`, or `oracle`: the AR
output corrupted to a fixed conditional acceptance) at each fixed γ (--gammas) and the
load-aware controller over --tiers (`dspec/decoding/controller.py`; its step costs are
profiled during the warm-up run, or read from --cost_table). Times are medians of
`timing_repeats` rounds after a warm-up (compile and profiling excluded), the methods
interleaved within each round. Writes
concurrency.json (rows), concurrency.md (table + goal checks) and concurrency.png.
Goals: controller ≥ 0.98× AR at every B; at B=1 within 5% of the best fixed γ.
"""

import json
import os
import statistics
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
_GAMMAS = flags.DEFINE_list('gammas', ['3', '7'], 'Fixed n-gram draft lengths.')
_TIERS = flags.DEFINE_list('tiers', ['0', '1', '3', '7', '15'], 'Controller tiers.')
_PROMPT_SET = flags.DEFINE_string('prompt_set', 'humaneval', 'Prompt set (corpus.py).')
_MAX_PROMPT = flags.DEFINE_integer('max_prompt_tokens', 64, 'Prompts cut to their last N.')
_DRAFTER = flags.DEFINE_enum('drafter', 'ngram', ['ngram', 'oracle'], 'Drafter.')
_ORACLE_ACC = flags.DEFINE_float('oracle_acceptance', 0.3, 'Oracle conditional acceptance.')
_OBJECTIVE = flags.DEFINE_enum(
    'objective', 'makespan', ['makespan', 'throughput'],
    "Controller objective. Every row here is one static batch, whose throughput is total "
    "tokens / time until its last row ends, so 'makespan' is the matching objective; "
    "'throughput' (committed tokens/s now) is the one for continuous batching.")
_COSTS = flags.DEFINE_string('cost_table', None, 'Step-cost JSON to load (if it exists) '
                             'and to save the profiled costs to.')


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
    ax_t.plot(xs, [r['tokens_per_s'] for r in pts], marker='o', label=method)
    ax_s.plot(xs, [r['speedup'] for r in pts], marker='o', label=method)
  for ax, label in ((ax_t, 'throughput (tokens/s)'), (ax_s, 'speedup vs AR')):
    ax.set_xscale('log', base=2)
    ax.set_xlabel('concurrency (batch size)')
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  ax_s.axhline(1.0, color='k', lw=0.8)
  ax_t.set_yscale('log')
  ax_s.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120, format='png')


def _markdown(rows, goals) -> str:
  methods = list(dict.fromkeys(r['method'] for r in rows))
  conc = sorted({r['concurrency'] for r in rows})
  cell = {(r['method'], r['concurrency']): r for r in rows}
  lines = ['| method | ' + ' | '.join(f'B={b}' for b in conc) + ' |',
           '|---|' + '---|' * len(conc)]
  for m in methods:
    lines.append(f'| {m} | ' + ' | '.join(
        f"{cell[m, b]['tokens_per_s']:.0f} tok/s ({cell[m, b]['speedup']:.2f}×)"
        for b in conc) + ' |')
  lines += ['', f"controller / AR, minimum over B: {goals['controller_vs_ar_min']:.3f} "
            f"(goal ≥ 0.98: {'met' if goals['controller_vs_ar_ok'] else 'NOT met'})",
            f"controller / best fixed γ at B=1: {goals['controller_vs_best_b1']:.3f} "
            f"(goal ≥ 0.95: {'met' if goals['controller_vs_best_b1_ok'] else 'NOT met'})",
            'lossless (greedy output == AR) for every row: '
            f"{all(r['lossless'] for r in rows)}"]
  return '\n'.join(lines) + '\n'


def main(argv):
  del argv
  import jax
  import numpy as np
  from flax import nnx
  from dspec import files, loading
  from dspec.decoding import runner
  from dspec.decoding.prompts import encode_prompts, generated_ids, pad_prompts
  from dspec.decoding.controller import ControllerConfig, CostTable, VerifyLengthController
  from dspec.decoding.drafters.ngram import NgramDrafter
  from dspec.decoding.drafters.oracle import OracleDrafter
  from dspec.decoding.engine import SpeculativeEngine

  cfg = _CONFIG.value
  settings = runner.Settings.from_config(cfg)
  spec = settings.sampling()
  if not spec.greedy:
    raise cli.UserError('bench_concurrency compares greedy outputs: use temperature=0')
  target, tokenizer, max_seq_len = loading.build_target(cfg.model)
  graphdef, params = nnx.split(target)
  stop_ids = tuple(tokenizer.stop_ids)
  ngram = cfg.drafters.ngram

  def drafter(g: int):
    if _DRAFTER.value == 'oracle':
      return OracleDrafter(num_draft=g, acceptance=(_ORACLE_ACC.value,))
    return NgramDrafter(num_draft=g, min_n=ngram.min_n, max_n=ngram.max_n)

  tiers = tuple(int(g) for g in _TIERS.value)
  costs = CostTable.load(_COSTS.value) if _COSTS.value and os.path.exists(
      _COSTS.value) else CostTable()
  controller = VerifyLengthController(
      graphdef, drafter(max(tiers)), sampling=spec, stop_ids=stop_ids, cost_table=costs,
      config=ControllerConfig(tiers=tiers, objective=_OBJECTIVE.value))
  methods = {'ar': SpeculativeEngine(graphdef, sampling=spec, stop_ids=stop_ids)}
  for g in _GAMMAS.value:
    methods[f'{_DRAFTER.value} γ={g}'] = SpeculativeEngine(
        graphdef, drafter=drafter(int(g)), sampling=spec, stop_ids=stop_ids)
  methods['controller'] = controller

  rows = []
  for b in [int(c) for c in _CONC.value]:
    prompt_BP, lens_B = pad_prompts(encode_prompts(
        _prompts(cfg, tokenizer, b), tokenizer, target.cfg.vocab_size, max_seq_len,
        cfg.max_new_tokens))
    # Warm-up (compile; the controller profiles), then timed rounds with the methods
    # interleaved so that load drift on a shared machine hits them alike.
    states, times = {}, {}
    for r in range(cfg.timing_repeats + 1):
      for name, engine in methods.items():
        state, _, decode_s = runner.run_generation(engine, params, None, prompt_BP,
                                                   lens_B, settings)
        states[name] = state
        if r:
          times.setdefault(name, []).append(decode_s)
    ar_ids = generated_ids(states['ar'])
    for name in methods:
      new_tokens = int(np.sum(np.asarray(states[name].num_tokens_B) - lens_B))
      decode_s = statistics.median(times[name])
      row = {'method': name, 'concurrency': b, 'tokens_per_s': new_tokens / decode_s,
             'decode_s': decode_s, 'new_tokens': new_tokens,
             'lossless': generated_ids(states[name]) == ar_ids}
      if name == 'controller':
        row['tier_usage'] = {str(g): round(f, 3) for g, f in controller.tier_usage().items()}
        row['step_costs_ms'] = {str(g): round(1e3 * controller.costs[b, g], 3)
                                for g in controller.tiers}
      rows.append(row)
      print(json.dumps(row), flush=True)
    ar_s = next(r['decode_s'] for r in rows if r['concurrency'] == b and r['method'] == 'ar')
    for r in rows:
      if r['concurrency'] == b:
        r['speedup'] = ar_s / r['decode_s']
    jax.clear_caches()

  by = {(r['method'], r['concurrency']): r for r in rows}
  conc = sorted({r['concurrency'] for r in rows})
  fixed = [m for m in methods if m.startswith(_DRAFTER.value)]
  b1 = conc[0]
  goals = {
      'controller_vs_ar_min': min(by['controller', b]['speedup'] for b in conc),
      'controller_vs_best_b1': by['controller', b1]['tokens_per_s'] / max(
          by[m, b1]['tokens_per_s'] for m in fixed + ['ar']),
  }
  goals['controller_vs_ar_ok'] = goals['controller_vs_ar_min'] >= 0.98
  goals['controller_vs_best_b1_ok'] = goals['controller_vs_best_b1'] >= 0.95
  out = {'rows': rows, 'goals': goals, 'device': str(jax.devices()[0]),
         'drafter': _DRAFTER.value, 'objective': _OBJECTIVE.value,
         'max_new_tokens': cfg.max_new_tokens,
         'tiers': list(tiers), 'model': target.cfg.to_dict()}
  files.write_json_atomic(os.path.join(_OUT.value, 'concurrency.json'), out)

  files.write_text_atomic(os.path.join(_OUT.value, 'concurrency.md'), _markdown(rows, goals))
  files.write_atomic(os.path.join(_OUT.value, 'concurrency.png'),
                     lambda tmp: _plot(rows, tmp))
  if _COSTS.value:
    controller.costs.save(_COSTS.value)
  print(_markdown(rows, goals))


if __name__ == '__main__':
  cli.run(main)
