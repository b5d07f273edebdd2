"""Benchmark outputs: atomic JSON, results.md tables, PNG plots, the docs/RESULTS.md section.

`write_outputs` writes plots, meta.json and results.md first and results.json last, each to
a temporary name then renamed (`dspec.files`), so a results.json only exists once a run has
finished. Summaries and plots show, per method, the size with the best geometric-mean
speedup over datasets at the smallest batch size (`best_sizes`; plots use T = 0). A run that
swept both verify lengths labels its methods `<method>/auto` and `<method>/fixed`.

Per condition (T, batch), `condition_table` gives every method × size: τ and speedup per
dataset, τ token-weighted over datasets, the geometric-mean and lowest speedup, the lowest
lossless_fraction, draft / verify cost and the controller's tier usage; and one plot
(`condition_plot_name`) of the per-position conditional acceptance P(n >= k | n >= k-1),
one line per method and size, from the per-position counters summed over datasets and
verify lengths (each verified draft position counts once: token-weighted, not a mean of
per-dataset curves; positions a step did not verify, as under a controller tier, are not
counted as rejections).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
from typing import Optional

from dspec.errors import UserError
from dspec.files import (mark, read_json, write_atomic, write_json_atomic, write_text_atomic,
                         written_by_dspec)

RESULTS = 'results.json'
PARTIAL = 'results.partial.json'
MIN_VERIFIED_TO_PLOT = 10   # conditional-acceptance plots skip rarer draft positions
META = 'meta.json'
MARKDOWN = 'results.md'
PLOTS = {
    'tau_histogram': 'tau_histogram.png',
    'per_position_acceptance': 'per_position_acceptance.png',
    'speedup_by_dataset': 'speedup_by_dataset.png',
    'speedup_vs_batch': 'speedup_vs_batch.png',
}


_LEGACY_META_KEYS = frozenset({'command', 'date', 'machine', 'config'})


def is_benchmark_dir(out_dir: str) -> bool:
  """Whether `out_dir` holds a benchmark run dspec wrote: a marked meta.json or partial
  results (`dspec.files.mark`), or a meta.json of a run from before the marks."""
  for name in (META, PARTIAL):
    path = os.path.join(out_dir, name)
    if os.path.isfile(path) and written_by_dspec(path):
      return True
  try:
    with open(os.path.join(out_dir, META)) as f:
      meta = json.load(f)
  except (OSError, ValueError):
    return False
  return isinstance(meta, dict) and _LEGACY_META_KEYS <= set(meta)


def remove_stale(out_dir: str, keep_partial: bool = False) -> None:
  """Creates `out_dir`; in a directory of an earlier benchmark run (`is_benchmark_dir`),
  removes its results.json so it cannot pass for this one (and its partial results unless
  this run resumes them). A directory dspec did not write is never emptied."""
  os.makedirs(out_dir, exist_ok=True)
  if not is_benchmark_dir(out_dir):
    return
  for name in (RESULTS,) if keep_partial else (RESULTS, PARTIAL):
    if os.path.exists(os.path.join(out_dir, name)):
      os.remove(os.path.join(out_dir, name))


def read_partial(path: str) -> dict:
  """The partial results of an interrupted run (`write_partial`); UserError naming `path`
  when they are unreadable or from an older dspec."""
  try:
    saved = read_json(path, 'partial-results file')
  except (OSError, ValueError) as e:
    raise UserError(f'{e}; rerun without --resume (or remove it)') from None
  if not isinstance(saved, dict) or not {'config', 'rows', 'wall_s', 'entropy',
                                          'draft_cost'} <= set(saved):
    raise UserError(f'{path} is not the partial results of a dspec benchmark of this '
                    'version and cannot be resumed; rerun without --resume')
  return saved


def write_partial(out_dir: str, progress: dict) -> None:
  write_json_atomic(os.path.join(out_dir, PARTIAL), mark(progress, 'benchmark partial'))


def json_ready(obj):
  """`obj` as it reads back from JSON (tuples become lists), for comparing configs."""
  return json.loads(json.dumps(obj, default=str))


def machine_info() -> dict:
  import jax
  cpu = platform.processor()
  if os.path.exists('/proc/cpuinfo'):
    with open('/proc/cpuinfo') as f:
      names = [line.split(':', 1)[1].strip() for line in f if line.startswith('model name')]
    cpu = names[0] if names else cpu
  device = jax.devices()[0]
  return {'cpu': cpu, 'cpu_count': os.cpu_count(), 'platform': platform.platform(),
          'python': platform.python_version(), 'jax': jax.__version__,
          'device': f'{device.platform}:{device.device_kind}'}


def run_metadata(cfg, command: str, wall_s: float) -> dict:
  return {'command': command,
          'date': datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC'),
          'machine': machine_info(), 'wall_s': wall_s, 'config': cfg.to_dict()}


def write_outputs(out_dir: str, rows: list, meta: dict) -> None:
  """Plots, meta.json, results.md, then results.json (all atomic); drops the partial file."""
  extra = make_plots(rows, out_dir)
  meta = dict(meta, plots=sorted(PLOTS.values()) + extra)
  write_json_atomic(os.path.join(out_dir, META), mark(meta, 'benchmark meta'))
  write_text_atomic(os.path.join(out_dir, MARKDOWN), render_markdown(rows, meta))
  write_json_atomic(os.path.join(out_dir, RESULTS), rows)
  if os.path.exists(os.path.join(out_dir, PARTIAL)):
    os.remove(os.path.join(out_dir, PARTIAL))


# ------------------------------------------------------------------------------ selection


def _dspec(rows) -> list:
  return [r for r in rows if r.get('engine', 'dspec') == 'dspec']


def _geomean(values) -> float:
  values = [v for v in values if v and v > 0]
  return math.exp(sum(map(math.log, values)) / len(values)) if values else float('nan')


def _ordered(values) -> list:
  return list(dict.fromkeys(values))


def _variant_fn(rows):
  """row -> its method label: the method, with '/auto' or '/fixed' when the run has rows of
  both verify lengths (AR stays 'ar')."""
  modes = {r.get('verify_length') for r in _dspec(rows) if r['method'] != 'ar'}
  if len(modes) < 2:
    return lambda r: r['method']
  return lambda r: r['method'] if r['method'] == 'ar' else f'{r["method"]}/{r["verify_length"]}'


def best_sizes(rows, temperature: float = 0.0, batch_size: Optional[int] = None) -> dict:
  """{method label: size} with the best geometric-mean speedup over datasets (AR excluded)."""
  rows, variant = _dspec(rows), _variant_fn(rows)
  batch_size = batch_size or min(r['batch_size'] for r in rows)
  picked = {}
  for method in _ordered(variant(r) for r in rows if r['method'] != 'ar'):
    sel = [r for r in rows if variant(r) == method and r['temperature'] == temperature
           and r['batch_size'] == batch_size]
    sizes = _ordered(r['num_draft'] for r in sel)
    if sizes:
      picked[method] = max(sizes, key=lambda s: _geomean(
          r['speedup'] for r in sel if r['num_draft'] == s))
  return picked


def _pick(rows, method, size, temperature, batch_size) -> list:
  variant = _variant_fn(rows)
  return [r for r in _dspec(rows) if variant(r) == method and r['num_draft'] == size
          and r['temperature'] == temperature and r['batch_size'] == batch_size]


def _conditions(rows) -> list:
  """[(T, batch)] of the dspec rows, in run order."""
  return _ordered((r['temperature'], r['batch_size']) for r in _dspec(rows))


def _entries(rows, temperature, batch_size) -> list:
  """[(method label, size)] of the non-AR rows at one condition, in run order."""
  variant = _variant_fn(rows)
  return _ordered((variant(r), r['num_draft']) for r in _dspec(rows) if r['method'] != 'ar'
                  and r['temperature'] == temperature and r['batch_size'] == batch_size)


def pooled_tau(sel) -> float:
  """τ over rows, token-weighted: Σ committed / Σ verify steps."""
  steps = sum(r.get('verify_steps', 0) for r in sel)
  if not steps:   # rows of runs before verify_steps was recorded: the plain mean
    return sum(r['tau'] for r in sel) / len(sel) if sel else float('nan')
  return sum(r['tau'] * r['verify_steps'] for r in sel) / steps


def pooled_conditional(sel) -> list:
  """P(n >= k | n >= k-1), k = 1..γ, pooled over rows from their per-position counters
  (exact under any verify length); rows without counters (older runs) from their summed
  τ histograms, exact only at a fixed verify length."""
  if all('position_reached' in r for r in sel):
    reached = [sum(col) for col in zip(*(r['position_reached'] for r in sel))]
    passed = [sum(col) for col in zip(*(r['position_passed'] for r in sel))]
    return [p / n if n else 0.0 for p, n in zip(passed, reached)]
  hist = [sum(col) for col in zip(*(r['tau_histogram'] for r in sel))]
  at_least = [sum(hist[k:]) for k in range(len(hist))]
  return [at_least[k] / at_least[k - 1] if at_least[k - 1] else 0.0
          for k in range(1, len(hist))]


def pooled_tiers(sel) -> Optional[dict]:
  """{tier: share of verify steps} over the rows' tier_steps (None without any)."""
  total = {}
  for r in sel:
    for g, n in (r.get('tier_steps') or {}).items():
      total[int(g)] = total.get(int(g), 0) + n
  steps = sum(total.values())
  return {g: n / steps for g, n in sorted(total.items())} if steps else None


def _tiers_cell(shares: Optional[dict]) -> Optional[str]:
  """'0:12% 7:88%' (tier: share of verify steps)."""
  return None if shares is None else ' '.join(f'{g}:{100 * v:.0f}%' for g, v in shares.items())


def condition_plot_name(temperature: float, batch_size: int) -> str:
  return f'conditional_acceptance_T{temperature:g}_b{batch_size}.png'


def _curves(rows, temperature, batch_size) -> list:
  """[(label, conditional curve, verified counts or None)] for one condition's plot, one
  per method and draft size, pooled over datasets and verify lengths."""
  sel = [r for r in _dspec(rows) if r['method'] != 'ar' and r['temperature'] == temperature
         and r['batch_size'] == batch_size]
  curves = []
  for method, size in _ordered((r['method'], r['num_draft']) for r in sel):
    group = [r for r in sel if r['method'] == method and r['num_draft'] == size]
    reached = None
    if all('position_reached' in r for r in group):
      reached = [sum(col) for col in zip(*(r['position_reached'] for r in group))]
    curves.append((f'{method} ({size})', pooled_conditional(group), reached))
  return curves


# ---------------------------------------------------------------------------------- plots


def make_plots(rows: list, out_dir: str) -> list:
  """The four PNGs of `PLOTS` and one conditional-acceptance plot per condition (atomic
  writes); returns the names of the latter."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  dspec_rows = _dspec(rows)
  batch = min(r['batch_size'] for r in dspec_rows)
  temps = _ordered(r['temperature'] for r in dspec_rows)
  t0 = 0.0 if 0.0 in temps else temps[0]
  datasets = _ordered(r['dataset'] for r in dspec_rows)
  chosen = best_sizes(rows, t0, batch)
  label = {m: f'{m} ({s})' for m, s in chosen.items()}

  def save(fig, key, name=None):
    def write(tmp):
      fig.savefig(tmp, format='png', dpi=110)
    write_atomic(os.path.join(out_dir, name or PLOTS[key]), write)
    plt.close(fig)

  # τ histogram: share of verify steps committing n tokens, pooled over datasets.
  n = max(len(chosen), 1)
  fig, axes = plt.subplots(1, n, figsize=(3.6 * n, 3.2), squeeze=False, layout='constrained')
  for ax, (method, size) in zip(axes[0], chosen.items()):
    hists = [r['tau_histogram'] for r in _pick(rows, method, size, t0, batch)]
    total = [sum(col) for col in zip(*hists)]
    steps = max(sum(total), 1)
    ax.bar(range(1, len(total) + 1), [c / steps for c in total])
    ax.set_title(label[method])
    ax.set_xlabel('tokens committed per step')
  axes[0][0].set_ylabel('share of steps')
  fig.suptitle(f'τ histogram (T={t0:g}, batch {batch}, all datasets)')
  save(fig, 'tau_histogram')

  # Per-position (unconditional) acceptance, one panel per dataset.
  cols = min(4, len(datasets))
  rows_n = -(-len(datasets) // cols)
  fig, axes = plt.subplots(rows_n, cols, figsize=(3.6 * cols, 3.0 * rows_n), squeeze=False,
                           layout='constrained')
  for ax, dataset in zip(axes.flat, datasets):
    for method, size in chosen.items():
      for r in _pick(rows, method, size, t0, batch):
        if r['dataset'] == dataset and r['per_position_acceptance']:
          acc = r['per_position_acceptance']
          ax.plot(range(1, len(acc) + 1), acc, marker='.', label=label[method])
    ax.set_title(dataset, fontsize=9)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel('draft position')
  for ax in list(axes.flat)[len(datasets):]:
    ax.axis('off')
  axes[0][0].set_ylabel('P(accepted)')
  handles, labels = axes[0][0].get_legend_handles_labels()
  if handles:
    fig.legend(handles, labels, loc='outside lower center', ncol=len(handles))
  fig.suptitle(f'Per-position acceptance (T={t0:g}, batch {batch})')
  save(fig, 'per_position_acceptance')

  # Speedup per dataset and method (grouped bars).
  fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(datasets)), 3.6), layout='constrained')
  width = 0.8 / n
  for k, (method, size) in enumerate(chosen.items()):
    by_ds = {r['dataset']: r['speedup'] for r in _pick(rows, method, size, t0, batch)}
    ax.bar([i + k * width for i in range(len(datasets))],
           [by_ds.get(d, 0.0) for d in datasets], width, label=label[method])
  ax.axhline(1.0, color='k', lw=0.8)
  ax.set_xticks([i + width * (n - 1) / 2 for i in range(len(datasets))])
  ax.set_xticklabels(datasets, rotation=30, ha='right', fontsize=8)
  ax.set_ylabel('speedup vs AR')
  ax.set_title(f'Speedup per dataset (T={t0:g}, batch {batch})')
  if chosen:
    ax.legend(fontsize=8)
  save(fig, 'speedup_by_dataset')

  # Speedup vs batch size: geometric mean over datasets.
  fig, ax = plt.subplots(figsize=(5.5, 3.6), layout='constrained')
  batches = sorted(_ordered(r['batch_size'] for r in dspec_rows))
  for method, size in chosen.items():
    for t, style in zip(temps, ('-', '--', ':')):
      ys = [_geomean(r['speedup'] for r in _pick(rows, method, size, t, b)) for b in batches]
      ax.plot(batches, ys, style, marker='o', label=f'{label[method]} T={t:g}')
  ax.axhline(1.0, color='k', lw=0.8)
  ax.set_xscale('log', base=2)
  ax.set_xticks(batches)
  ax.set_xticklabels([str(b) for b in batches])
  ax.set_xlabel('batch size')
  ax.set_ylabel('speedup vs AR (geo-mean over datasets)')
  if chosen:
    ax.legend(fontsize=7)
  save(fig, 'speedup_vs_batch')

  # Conditional acceptance per condition, pooled over datasets (the suffix-decay curve).
  names = []
  for t, b in _conditions(rows):
    fig, ax = plt.subplots(figsize=(5.5, 3.6), layout='constrained')
    for label_, curve, reached in _curves(rows, t, b):
      if reached is not None:   # a ratio of a handful of steps is noise, not a curve
        curve = [c if n >= MIN_VERIFIED_TO_PLOT else math.nan for c, n in zip(curve, reached)]
      if curve:
        ax.plot(range(1, len(curve) + 1), curve, marker='.', label=label_)
    ax.set_ylim(0, 1.02)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel('draft position k')
    ax.set_ylabel('P(accept k | accepted k-1)')
    ax.set_title(f'Conditional acceptance (T={t:g}, batch {b}, all datasets)\n'
                 f'positions verified >= {MIN_VERIFIED_TO_PLOT} times', fontsize=9)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=7)
    names.append(condition_plot_name(t, b))
    save(fig, None, names[-1])
  return names


# ------------------------------------------------------------------------------- markdown


def _fmt(value, digits: int = 2) -> str:
  if value is None:
    return '–'
  if isinstance(value, bool):
    return 'yes' if value else 'no'
  if isinstance(value, float):
    return 'nan' if math.isnan(value) else f'{value:.{digits}f}'
  return str(value)


def _table(header: list, body: list) -> str:
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  lines += ['| ' + ' | '.join(_fmt(v) for v in row) + ' |' for row in body]
  return '\n'.join(lines)


def summary_table(rows: list, temperature: float, batch_size: int) -> str:
  """Spec-Bench leaderboard style: speedup per dataset, mean τ, geometric-mean speedup."""
  datasets = _ordered(r['dataset'] for r in _dspec(rows))
  body = []
  for method, size in best_sizes(rows, temperature, batch_size).items():
    sel = _pick(rows, method, size, temperature, batch_size)
    by_ds = {r['dataset']: r['speedup'] for r in sel}
    taus = [r['tau'] for r in sel]
    body.append([f'{method} ({size})'] + [by_ds.get(d) for d in datasets]
                + [sum(taus) / len(taus), _geomean(by_ds.values())])
  return _table(['method (size)'] + [f'{d} speedup' for d in datasets]
                + ['mean τ', 'overall speedup'], body)


def _speedup_cell(row: dict) -> str:
  """'1.23×', with the lowest and highest per-round speedup when there were several rounds."""
  rounds = row.get('speedup_rounds') or []
  spread = f' ({min(rounds):.2f}–{max(rounds):.2f})' if len(rounds) > 1 else ''
  return f'{row["speedup"]:.2f}×{spread}'


def condition_table(rows: list, temperature: float, batch_size: int) -> str:
  """Every method × size at one condition: τ / speedup (its per-round range) per dataset,
  τ token-weighted over datasets, geometric-mean and lowest speedup, lowest
  lossless_fraction, draft / verify, tier usage (auto)."""
  datasets = _ordered(r['dataset'] for r in _dspec(rows))
  body = []
  for method, size in _entries(rows, temperature, batch_size):
    sel = _pick(rows, method, size, temperature, batch_size)
    by_ds = {r['dataset']: r for r in sel}
    lossless = [r['lossless_fraction'] for r in sel if r['lossless_fraction'] is not None]
    costs = [r['draft_over_verify'] for r in sel if r.get('draft_over_verify') is not None]
    body.append([f'{method} ({size})']
                + [f'{by_ds[d]["tau"]:.2f} / {_speedup_cell(by_ds[d])}' if d in by_ds
                   else None for d in datasets]
                + [pooled_tau(sel), _geomean(r['speedup'] for r in sel),
                   min(r['speedup'] for r in sel), min(lossless) if lossless else None,
                   costs[0] if costs else None, _tiers_cell(pooled_tiers(sel))])
  return _table(['method (size)'] + [f'{d} τ / speedup' for d in datasets]
                + ['τ (all)', 'speedup (geo-mean)', 'lowest speedup', 'lossless (lowest)',
                   'draft / verify', 'tiers (share of steps)'], body)


def _header(meta: dict) -> str:
  m = meta['machine']
  return '\n'.join([
      f'- Command: `{meta["command"]}`',
      f'- Machine: {m["cpu"]}, {m["cpu_count"]} cores, {m["device"]}, {m["platform"]}, '
      f'Python {m["python"]}, jax {m["jax"]}',
      f'- Date: {meta["date"]}; wall time {meta["wall_s"] / 60:.1f} min',
  ])


def _settings(meta: dict) -> str:
  c = meta['config']
  b, model = c['bench'], c['model']
  where = (model['path'] if model['source'] != 'random'
           else f'random {model["shape"]["num_layers"]}-layer target')
  cut = f' (last {b["max_prompt_tokens"]} prompt tokens kept)' if b['max_prompt_tokens'] else ''
  modes = meta.get('verify_lengths') or [c.get('verify_length', 'fixed')]
  return (f'Target: {where}. {b["num_prompts"]} prompts per dataset{cut}, '
          f'max_new_tokens={c["max_new_tokens"]}, warm-up + median of {c["timing_repeats"]} '
          f'timed runs per batch; speedup = AR decode time / method decode time in the same '
          f'process (token-rate ratio at T > 0). Verify length: {" and ".join(modes)} '
          f'(auto: the load-aware controller picks each chunk\'s tier, 0 = AR; fixed: every '
          f'step verifies num_draft).')


def _body(rows: list, meta: dict, image_dir: str, heading: str) -> list:
  dspec_rows = _dspec(rows)
  batch = min(r['batch_size'] for r in dspec_rows)
  parts = []
  for t in _ordered(r['temperature'] for r in dspec_rows):
    parts += [f'{heading} Speedup summary, T={t:g}, batch {batch}', '',
              summary_table(rows, t, batch), '']
  for t, b in _conditions(rows):
    if _entries(rows, t, b):
      parts += [f'{heading} Per method, T={t:g}, batch {b}', '', condition_table(rows, t, b),
                '', f'![conditional acceptance T={t:g} batch {b}]'
                f'({_image(image_dir, condition_plot_name(t, b))})', '']
  lossy = [r for r in dspec_rows if r['temperature'] == 0 and r['lossless_fraction'] != 1.0]
  verdict = f'{len(lossy)} T=0 rows below 1.0' if lossy else 'every T=0 row is 1.0'
  parts += [f'Greedy losslessness (lossless_fraction): {verdict}.', '']
  peer = meta.get('peer')
  if peer:
    parts += [f'{heading} Peer: transformers generate (CPU, {peer["torch_threads"]} torch '
              f'threads, {peer["dataset"]}, {peer["num_prompts"]} prompts, T=0, batch 1)', '']
    hf_rows = [r for r in rows if r.get('engine') == 'transformers']
    parts += [_table(['method', 'K', 'tokens/s', 'speedup vs HF AR', 'dspec counterpart tok/s',
                      'dspec / HF', 'same output as reference'],
                     [[r['method'], r['num_draft'], r['tokens_per_s'], r['speedup'],
                       r['dspec_tokens_per_s'], r['dspec_over_hf'], r['lossless_fraction']]
                      for r in hf_rows]), '']
    best = peer['dspec_best']
    parts += [
        f'- AR: dspec {peer["dspec_ar_tokens_per_s"]:.1f} tok/s vs HF '
        f'{peer["hf_ar_tokens_per_s"]:.1f} tok/s → ratio {peer["ar_ratio"]:.2f} '
        f'(goal ≥ 1: {"met" if peer["goal_ar"] else "not met"}).',
        '- Best speculative: dspec '
        + (f'{best["method"]} ({best["num_draft"]}) {best["speedup"]:.2f}×, '
           f'{best["tokens_per_s"]:.1f} tok/s' if best else 'none')
        + f' vs HF {peer["hf_best"]["method"]} {peer["hf_best"]["speedup"]:.2f}×, '
        f'{peer["hf_best"]["tokens_per_s"]:.1f} tok/s → speedup ratio '
        f'{_fmt(peer["best_speedup_ratio"])}, tokens/s ratio '
        f'{_fmt(peer["best_tokens_per_s_ratio"])} (goal speedup ratio ≥ 2: '
        f'{"met" if peer["goal_speculative"] else "not met"}).',
        f'- HF assistant model: {peer["assistant"]}; HF AR "same output" compares with '
        f'dspec AR, the others with HF AR.', '']
  ar_rows = [r for r in dspec_rows if r['method'] == 'ar' and 'distinct_4' in r]
  if ar_rows:
    parts += [f'{heading} The target\'s own output (AR)', '',
              'distinct-4 = mean over prompts of distinct / total 4-grams of the AR output '
              '(1.0: no repeated 4-gram; a loop of period p tends to p / length). The sample '
              'is the first prompt\'s output.', '',
              _table(['dataset', 'T', 'batch', 'distinct-4', 'sample (first prompt)'],
                     [[r['dataset'], r['temperature'], r['batch_size'], r['distinct_4'],
                       _sample_cell(r['sample'])] for r in ar_rows]), '']
  parts += [f'{heading} Entropy and speed-of-light bound per dataset', '',
            'μ = mean next-token entropy (nats) of the target along its AR outputs, μ₂ = mean '
            'Σp(log p)²; bound(P) = min(P, 1 + (μ+μ₂)·ln P/μ²) (`dspec/bench/sol.py`), only at '
            'T > 0, from the distribution at that temperature along the AR outputs. At T = 0 '
            'the rows report the greedy oracle ceiling instead.', '',
            _table(['dataset', 'T', 'μ', 'μ₂', 'mean H²', 'tokens', 'bound P=4', 'bound P=8',
                    'bound P=16'],
                   [[e['dataset'], e['temperature'], e['entropy_mu'], e['entropy_mu2'],
                     e['entropy_h2'], e['entropy_tokens']]
                    + [_bound(e, p) for p in (4, 8, 16)] for e in meta.get('entropy', [])]), '']
  if meta.get('skipped'):
    parts += ['Skipped methods: ' + '; '.join(f'{m} ({why})'
                                              for m, why in meta['skipped'].items()), '']
  parts += [f'{heading} Plots', '']
  parts += [f'![{key}]({_image(image_dir, name)})' for key, name in PLOTS.items()]
  parts += ['', f'{heading} All runs', '', _table(
      ['dataset', 'method', 'T', 'batch', 'size', 'verify', 'τ', 'α', 'speedup', 'tok/s',
       'AR tok/s', 'lossless', 'SOL bound (T>0)', 'oracle ceiling (T=0)', 'tiers',
       'compile s'],
      [[r['dataset'], r['method'], r['temperature'], r['batch_size'], r['num_draft'],
        r.get('verify_length'), r['tau'], r['acceptance_rate'], r['speedup'],
        r['tokens_per_s'], r['ar_tokens_per_s'], r['lossless_fraction'], r['sol_bound'],
        r.get('greedy_oracle_ceiling'), _tiers_cell(pooled_tiers([r])), r['compile_s']]
       for r in dspec_rows]), '']
  return parts


def _image(image_dir: str, name: str) -> str:
  return os.path.join(image_dir, name) if image_dir else name


def _sample_cell(text: str, limit: int = 160) -> str:
  """One table cell of generated text: newlines shown as ⏎, pipes escaped, truncated."""
  text = text if len(text) <= limit else text[:limit] + '…'
  return '`' + text.replace('\n', '⏎').replace('|', '\\|').replace('`', "'") + '`'


def _bound(entropy: dict, width: int) -> float:
  from dspec.bench.sol import sol_bound
  return sol_bound(entropy['entropy_mu'], entropy['entropy_mu2'], width)


def render_markdown(rows: list, meta: dict, image_dir: str = '') -> str:
  """results.md: run header, summaries, peer, entropy, plots and every run."""
  return '\n'.join(['# dspec benchmark', '', _header(meta), '', _settings(meta), '']
                   + _body(rows, meta, image_dir, '##'))


def render_results_section(out_dir: str, docs_dir: str = 'docs',
                           title: Optional[str] = None) -> str:
  """A docs/RESULTS.md section for the finished run in `out_dir` (plots linked relatively)."""
  rows = read_json(os.path.join(out_dir, RESULTS), 'benchmark results file')
  meta = read_json(os.path.join(out_dir, META), 'benchmark meta file')
  title = title or f'Benchmark: {os.path.basename(os.path.normpath(out_dir))}'
  image_dir = os.path.relpath(out_dir, docs_dir)
  return '\n'.join([f'## {title}', '', _header(meta), '', _settings(meta), '']
                   + _body(rows, meta, image_dir, '###'))
