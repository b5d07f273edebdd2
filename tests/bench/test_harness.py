"""Benchmark harness: the tiny config end to end, atomic outputs, SOL bound, datasets,
verify lengths (auto / fixed), skipped checkpoints, the family preset."""

import json
import math
import os
import time

import jax
import numpy as np
import pytest

from configs import bench_demo, bench_tiny, common_bench
from dspec.bench import harness, report, sol
from dspec.errors import UserError
from dspec.decoding import runner
from dspec.decoding.controller import VerifyLengthController
from dspec.decoding.drafters.suffix import SuffixDrafter
from dspec.decoding.engine import SpeculativeEngine
from dspec.decoding.host_loop import HostEngine
from dspec.decoding.prompts import pad_prompts

REQUIRED = ('dataset', 'method', 'temperature', 'batch_size', 'num_draft', 'tau',
            'per_position_acceptance', 'speedup', 'tokens_per_s', 'ar_tokens_per_s',
            'lossless_fraction', 'sol_bound')


def _tiny_cfg():
  cfg = bench_tiny.get_config('t0')
  cfg.bench.datasets = ('humaneval', 'spec_bench/qa')
  cfg.bench.batch_sizes = (1,)
  cfg.max_new_tokens = 8
  return cfg


@pytest.fixture(scope='module')
def bench_dir(tmp_path_factory):
  out = str(tmp_path_factory.mktemp('bench'))
  harness.run_benchmark(_tiny_cfg(), out, 'python scripts/benchmark.py (test)')
  return out


@pytest.mark.slow
def test_tiny_bench_end_to_end(bench_dir):
  with open(os.path.join(bench_dir, report.RESULTS)) as f:
    rows = json.load(f)
  dspec_rows = [r for r in rows if r['engine'] == 'dspec']
  assert {(r['dataset'], r['method']) for r in dspec_rows} == {
      (d, m) for d in ('humaneval', 'spec_bench/qa') for m in ('ar', 'ngram', 'suffix')}
  for r in rows:
    assert all(k in r for k in REQUIRED), sorted(set(REQUIRED) - set(r))
  for r in dspec_rows:
    assert r['lossless_fraction'] == 1.0
    assert r['num_prompts'] == 2 and r['tau'] >= 1.0 and r['speedup'] > 0
    assert r['speedup_rounds'] == [pytest.approx(r['speedup'])]   # one timed round
    # The config's verify_length (default auto) when bench.verify_lengths is empty.
    assert r['verify_length'] == (None if r['method'] == 'ar' else 'auto')
    if r['temperature'] == 0:   # no bound at T = 0; nothing beats the oracle ceiling
      assert r['sol_bound'] is None
      assert r['tau'] <= r['greedy_oracle_ceiling'] + 1e-9 <= r['num_draft'] + 1 + 1e-9
    else:
      assert 1.0 <= r['sol_bound'] <= r['num_draft'] + 1
  assert [r['method'] for r in rows if r['engine'] == 'transformers'] == [
      'hf_ar', 'hf_prompt_lookup', 'hf_assisted']
  hf_ar = next(r for r in rows if r['method'] == 'hf_ar')
  assert hf_ar['lossless_fraction'] == 1.0, 'HF greedy output differs from dspec AR'
  for name in list(report.PLOTS.values()) + [report.MARKDOWN, report.META]:
    assert os.path.getsize(os.path.join(bench_dir, name)) > 0, name
  assert not os.path.exists(os.path.join(bench_dir, report.PARTIAL))
  with open(os.path.join(bench_dir, report.META)) as f:
    meta = json.load(f)
  assert meta['peer']['dspec_ar_tokens_per_s'] > 0
  assert bool(meta['entropy']) == any(r['temperature'] > 0 for r in dspec_rows)
  for r in dspec_rows:
    if r['method'] == 'ar':
      assert 0.0 < r['distinct_4'] <= 1.0 and isinstance(r['sample'], str)


def test_speedup_rounds_pair_each_round_with_ars():
  """Per-round speedups take every batch's time in that round, AR's from the same round;
  the table cell shows their range."""
  method, ar = harness.RunResult(4), harness.RunResult(0)
  method.decode_s_rounds, method.new_tokens = [[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]], [10, 20]
  ar.decode_s_rounds, ar.new_tokens = [[2.0, 2.0, 2.0], [2.0, 4.0, 6.0]], [10, 20]
  assert method.tokens_per_s_rounds() == [15.0, 10.0, 7.5]
  assert ar.tokens_per_s_rounds() == [7.5, 5.0, 3.75]
  row = {'speedup': 2.0, 'speedup_rounds': [2.0, 2.0, 1.5]}
  assert report._speedup_cell(row) == '2.00× (1.50–2.00)'
  assert report._speedup_cell({'speedup': 2.0, 'speedup_rounds': [2.0]}) == '2.00×'


@pytest.mark.slow
def test_results_section_renders(bench_dir):
  text = report.render_results_section(bench_dir, docs_dir=os.path.dirname(bench_dir))
  assert 'Command: `python scripts/benchmark.py (test)`' in text and 'Machine:' in text
  assert 'Date:' in text and '| ngram (4) |' in text
  assert f'({os.path.basename(bench_dir)}/speedup_by_dataset.png)' in text
  assert "The target's own output (AR)" in text and '| distinct-4 |' in text


def test_interrupted_write_leaves_no_results(tmp_path, monkeypatch):
  path = str(tmp_path / report.RESULTS)
  report.write_json_atomic(path, [{'old': 1}])

  def broken_dump(obj, f, **kw):
    f.write('[{"dataset": ')
    raise KeyboardInterrupt

  monkeypatch.setattr(json, 'dump', broken_dump)
  with pytest.raises(KeyboardInterrupt):
    report.write_json_atomic(path, [{'new': 2}])
  monkeypatch.undo()
  with open(path) as f:
    assert json.load(f) == [{'old': 1}]
  assert os.listdir(tmp_path) == [report.RESULTS]


@pytest.mark.slow
def test_interrupted_run_removes_stale_results_of_dspec_only(tmp_path, monkeypatch):
  """An earlier run's results.json cannot pass for this one; a results.json in a directory
  dspec did not write is never deleted."""
  ours, theirs = tmp_path / 'ours', tmp_path / 'theirs'
  for d in (ours, theirs):
    d.mkdir()
    report.write_json_atomic(str(d / report.RESULTS), [{'stale': True}])
  report.write_json_atomic(str(ours / report.META), report.mark({'wall_s': 1.0}, 'meta'))

  def interrupted(self, *args):
    raise KeyboardInterrupt

  monkeypatch.setattr(harness.Benchmark, 'run_sweep_point', interrupted)
  for d in (ours, theirs):
    with pytest.raises(KeyboardInterrupt):
      harness.run_benchmark(_tiny_cfg(), str(d))
  assert not os.path.exists(ours / report.RESULTS)
  assert json.loads((theirs / report.RESULTS).read_text()) == [{'stale': True}]


@pytest.mark.slow
def test_resume_skips_finished_sweep_points(tmp_path, monkeypatch):
  """An interrupted run keeps its finished sweep points; --resume runs only the rest, and
  refuses partial results of another config."""
  def cfg(max_new_tokens=8):
    c = _tiny_cfg()
    c.bench.hf_peer = False
    c.max_new_tokens = max_new_tokens
    return c

  real = harness.Benchmark.run_sweep_point
  ran = []

  def interrupted_after_one(self, dataset, *args):
    if ran:
      raise KeyboardInterrupt
    ran.append(dataset)
    return real(self, dataset, *args)

  monkeypatch.setattr(harness.Benchmark, 'run_sweep_point', interrupted_after_one)
  with pytest.raises(KeyboardInterrupt):
    harness.run_benchmark(cfg(), str(tmp_path))
  assert not os.path.exists(tmp_path / report.RESULTS)
  with pytest.raises(UserError, match='max_new_tokens'):
    harness.run_benchmark(cfg(9), str(tmp_path), resume=True)

  def recorded(self, dataset, *args):
    ran.append(dataset)
    return real(self, dataset, *args)

  monkeypatch.setattr(harness.Benchmark, 'run_sweep_point', recorded)
  rows = harness.run_benchmark(cfg(), str(tmp_path), resume=True)
  assert ran == ['humaneval', 'spec_bench/qa']
  assert sorted((r['dataset'], r['method']) for r in rows) == [
      (d, m) for d in ('humaneval', 'spec_bench/qa') for m in ('ar', 'ngram', 'suffix')]
  with open(tmp_path / report.META) as f:
    assert json.load(f)['resumed']


def test_distinct_ngram_ratio():
  from dspec.metrics import distinct_ngram_ratio
  assert distinct_ngram_ratio([[1, 2, 3, 4, 5]], 4) == 1.0
  assert distinct_ngram_ratio([[7, 8] * 10], 4) == pytest.approx(2 / 17)   # period-2 loop
  assert distinct_ngram_ratio([[1, 2, 3, 4, 5], [7, 8] * 10, [1]], 4) == pytest.approx(
      (1 + 2 / 17) / 2)
  assert math.isnan(distinct_ngram_ratio([[1, 2]], 4))


def test_sol_bound_formula():
  assert sol.sol_bound(3.0, 10.0, 8) == pytest.approx(1 + 13 * math.log(8) / 9)
  assert sol.sol_bound(0.5, 0.6, 8) == 8.0, 'capped at P'
  assert sol.sol_bound(0.5, 0.6, 1) == 1.0 and sol.sol_bound(0.0, 0.0, 4) == 4.0


def test_mt_bench_group_interleaves_categories():
  prompts = harness.load_dataset('spec_bench/mt_bench', 'data', 16)
  assert len(prompts) == 16 and len(set(prompts)) == 16
  writing = harness.load_dataset('spec_bench/writing', 'data', 2)
  assert prompts[0] == writing[0] and prompts[8] == writing[1]


def test_bad_method_and_peer_settings_are_user_errors():
  cfg = _tiny_cfg()
  cfg.bench.methods = ('ngram', 'nope')
  with pytest.raises(harness.UserError, match='unknown bench method'):
    harness.plan_methods(cfg)
  cfg = _tiny_cfg()
  cfg.bench.hf.dataset = 'gsm8k_test'
  with pytest.raises(harness.UserError, match='hf_peer'):
    harness.validate(cfg)


@pytest.mark.parametrize('arg', [None, 'quick', 'full', 'goals'])
def test_demo_bench_presets_plan_every_method(arg):
  cfg = bench_demo.get_config(arg)
  harness.validate(cfg)
  plan, skipped = harness.plan_methods(cfg)
  assert not skipped and {m for m, _ in plan} == {'ngram', 'suffix', 'mtp', 'dflash'}
  assert len(cfg.bench.datasets) == (2 if arg == 'goals' else 8) and cfg.bench.hf_peer
  cfg.bench.methods = ('mtp', 'mtp_vocab')   # a variant takes its drafter's sizes
  assert harness.plan_methods(cfg)[0] == [('mtp', 3), ('mtp_vocab', 3)]
  cfg.drafters.mtp.path = ''
  assert 'mtp' in harness.plan_methods(cfg)[1], 'a method without a checkpoint is skipped'


PROFILE_SLEEP_S = 1.5


@pytest.fixture(scope='module')
def both_modes(tmp_path_factory):
  """ngram and suffix under auto and fixed, one dataset, a missing MTP checkpoint, draft
  costs; the controller's profiling made slow to show it stays out of decode_s."""
  out = str(tmp_path_factory.mktemp('bench_modes'))
  cfg = _tiny_cfg()
  cfg.bench.datasets = ('humaneval',)
  cfg.bench.hf_peer = False
  cfg.bench.methods = ('ngram', 'suffix', 'mtp')
  cfg.drafters.mtp.path = os.path.join(out, 'no_such_mtp')
  cfg.bench.verify_lengths = ('auto', 'fixed')
  cfg.bench.draft_cost_repeats = 2
  cfg.timing_repeats = 2
  profile = VerifyLengthController.profile
  calls = []

  def slow_profile(self, *args):
    calls.append(self)
    time.sleep(PROFILE_SLEEP_S)
    return profile(self, *args)

  generation = runner.run_generation
  engines = []   # the engine of every generation, in the order they ran

  def recorded_generation(engine, *args):
    engines.append(engine)
    return generation(engine, *args)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(VerifyLengthController, 'profile', slow_profile)
    mp.setattr(runner, 'run_generation', recorded_generation)
    bench = harness.Benchmark(cfg, out, 'python scripts/benchmark.py (modes)')
    bench.run()
  with open(os.path.join(out, report.RESULTS)) as f:
    rows = json.load(f)
  with open(os.path.join(out, report.META)) as f:
    meta = json.load(f)
  bench.generation_engines = engines
  return bench, rows, meta, calls, out


@pytest.mark.slow
def test_ar_and_the_methods_take_turns(both_modes):
  """Per batch, a warm-up round and then each timed round run AR and every method once in
  turn, the second timed round starting one later: the machine's drift falls on all
  alike."""
  bench, _, _, _, _ = both_modes
  order = {}
  runs = [order.setdefault(id(e), len(order)) for e in bench.generation_engines]
  # AR; ngram and suffix, each auto and fixed (MTP is skipped); two timed rounds.
  per_batch = [0, 1, 2, 3, 4] * 2 + [1, 2, 3, 4, 0]
  assert runs == per_batch * bench.cfg.bench.num_prompts


def _by(rows, method, verify_length):
  return next(r for r in rows if r['method'] == method and r['verify_length'] == verify_length)


@pytest.mark.slow
def test_auto_rows_have_tier_steps_and_stay_lossless(both_modes):
  bench, rows, _, calls, _ = both_modes
  for method in ('ngram', 'suffix'):
    r = _by(rows, method, 'auto')
    assert r['lossless_fraction'] == 1.0 and r['temperature'] == 0
    tiers = {int(g): n for g, n in r['tier_steps'].items()}
    # Batch 1, no filler rows: the tiers' steps are the row's verify steps.
    assert sum(tiers.values()) == r['verify_steps'] > 0
    assert set(tiers) <= ({0, 1, 3, 4} if method == 'ngram' else {0, 4})
  # Two controllers (ngram and suffix at T = 0), each profiled once (batch 1) in its first
  # warm-up run; suffix's positive tiers propose on the host.
  controllers = [e.engine for e in bench.engines.values()
                 if isinstance(e.engine, VerifyLengthController)]
  assert len(controllers) == 2 and calls == controllers
  for method in ('ngram', 'suffix'):
    r = _by(rows, method, 'auto')
    assert r['decode_s'] < PROFILE_SLEEP_S <= r['compile_s'], 'profiling was timed'
  suffix = [e.engine for (key, vl, _), e in bench.engines.items() if key == ('suffix', 4)
            and vl == 'auto']
  assert len(suffix) == 1 and isinstance(suffix[0].host, HostEngine)


@pytest.mark.slow
def test_fixed_rows_verify_every_proposal(both_modes):
  bench, rows, _, _, _ = both_modes
  for method in ('ngram', 'suffix'):
    r = _by(rows, method, 'fixed')
    assert r['tier_steps'] is None and r['lossless_fraction'] == 1.0
    assert len(r['tau_histogram']) == r['num_draft'] + 1
  fixed = {key[0]: type(e.engine) for (key, vl, _), e in bench.engines.items()
           if vl == 'fixed'}
  assert fixed == {'ngram': SpeculativeEngine, 'suffix': HostEngine}
  ar = next(r for r in rows if r['method'] == 'ar')
  assert ar['verify_length'] is None and ar['tier_steps'] is None


@pytest.mark.slow
def test_missing_checkpoint_dir_is_skipped_with_reason(both_modes, tmp_path):
  _, rows, meta, _, out = both_modes
  assert 'mtp' not in {r['method'] for r in rows}
  assert meta['skipped'] == {'mtp': f'no checkpoint: {out}/no_such_mtp does not exist'}
  with open(os.path.join(out, report.MARKDOWN)) as f:
    assert 'Skipped methods: mtp (no checkpoint:' in f.read()
  cfg = _tiny_cfg()
  cfg.bench.methods = ('ngram', 'mtp', 'dflash2')
  cfg.drafters.mtp.path = str(tmp_path)     # exists: planned (its build would load it)
  plan, skipped = harness.plan_methods(cfg)
  assert plan == [('ngram', 4), ('mtp', 3)]   # bench.method_sizes.mtp
  assert skipped == {'dflash2': 'no checkpoint: drafters.dflash.path is empty'}


@pytest.mark.slow
def test_draft_cost_and_condition_report(both_modes):
  _, rows, meta, _, out = both_modes
  assert _by(rows, 'ngram', 'auto')['draft_over_verify'] > 0
  assert _by(rows, 'suffix', 'auto')['draft_over_verify'] is None   # host drafter
  assert [(c['method'], c['batch_size']) for c in meta['draft_cost']] == [('ngram', 1)]
  with open(os.path.join(out, report.MARKDOWN)) as f:
    text = f.read()
  assert '## Per method, T=0, batch 1' in text and 'Verify length: auto and fixed' in text
  for label in ('ngram/auto (4)', 'ngram/fixed (4)', 'suffix/auto (4)', 'suffix/fixed (4)'):
    assert f'| {label} |' in text
  name = report.condition_plot_name(0.0, 1)
  assert name in meta['plots'] and os.path.getsize(os.path.join(out, name)) > 0
  # One curve per method, pooled over both verify lengths from the per-position counters.
  (label, curve, counts), _ = report._curves(rows, 0.0, 1)
  fixed, auto = _by(rows, 'ngram', 'fixed'), _by(rows, 'ngram', 'auto')
  reached = np.add(fixed['position_reached'], auto['position_reached'])
  passed = np.add(fixed['position_passed'], auto['position_passed'])
  assert label == 'ngram (4)' and reached[0] > 0 and counts == list(reached)
  assert curve == pytest.approx(list(np.where(reached > 0, passed / np.maximum(reached, 1), 0)))
  assert fixed['per_position_acceptance_conditional'] == pytest.approx(
      list(np.where(np.asarray(fixed['position_reached']) > 0, np.asarray(
          fixed['position_passed']) / np.maximum(fixed['position_reached'], 1), 0)))


def test_pooled_conditional_is_step_weighted():
  rows = [{'position_reached': [10, 4], 'position_passed': [4, 2]},
          {'position_reached': [10, 10], 'position_passed': [10, 9]}]
  assert report.pooled_conditional(rows) == pytest.approx([14 / 20, 11 / 14])
  rows = [{'tau_histogram': [6, 2, 2]}, {'tau_histogram': [0, 0, 10]}]   # older rows
  # at_least = [20, 14, 12]
  assert report.pooled_conditional(rows) == pytest.approx([14 / 20, 12 / 14])
  rows = [{'tau': 2.0, 'verify_steps': 10}, {'tau': 4.0, 'verify_steps': 30}]
  assert report.pooled_tau(rows) == pytest.approx(3.5)


def test_verify_length_settings():
  cfg = _tiny_cfg()
  assert harness.verify_lengths(cfg) == ('auto',)
  cfg.verify_length = 'fixed'
  assert harness.verify_lengths(cfg) == ('fixed',)
  cfg.bench.verify_lengths = ('fixed', 'nope')
  with pytest.raises(harness.UserError, match='verify length'):
    harness.validate(cfg)
  cfg = _tiny_cfg()
  cfg.timing_repeats = 0
  with pytest.raises(harness.UserError, match='timing_repeats'):
    harness.validate(cfg)


def test_family_preset_plan():
  cfg = bench_demo.get_config('family')
  harness.validate(cfg)
  b = cfg.bench
  assert tuple(b.datasets) == common_bench.ALL_DATASETS and b.num_prompts == 10
  assert tuple(b.temperatures) == (0.0, 1.0) and tuple(b.batch_sizes) == (1, 16)
  assert harness.verify_lengths(cfg) == ('auto',) and not b.hf_peer
  assert cfg.model.path == 'demo/target'
  plan, skipped = harness.plan_methods(cfg)
  learned = ('mtp', 'eagle3', 'dflash', 'dflash2', 'dspark')
  assert [(m, s) for m, s in plan] == [('ngram', 7)] + [(m, 0) for m in learned
                                                        if m not in skipped]
  for method in learned:   # demo/<method>: planned when it exists, else skipped with why
    path = f'demo/{method}'
    assert (method in skipped) == (not os.path.isdir(path))
    if method in skipped:
      assert skipped[method] == f'no checkpoint: {path} does not exist'
  c = harness.run_config(cfg, 'dflash2', size=0)
  assert c.drafter == 'dflash' and c.drafters.dflash.path == 'demo/dflash2'
  assert c.drafters.dflash.num_draft == 0
  assert bench_demo.get_config('family,target=demo/target_v2').model.path == 'demo/target_v2'


class _WrongHostDrafter:
  """Proposes 4 × token 0 for every live row (on the tiny target, rejected)."""

  def start(self, prompts):
    pass

  def propose(self, sequences, live):
    return np.zeros((len(sequences), 4), np.int32), np.full((len(sequences),), 4) * live

  def finish(self, sequences):
    pass


@pytest.mark.slow
def test_a_host_controller_compiles_nothing_once_warm(tiny_split):
  """Under auto a host drafter's controller compiles its tiers' steps and judges before
  the first generation's decode (prefill and profile); a later generation, which the
  benchmark times, compiles nothing: a compile there lands in the steps the cost table
  and the estimate see. Batch 5: no other test compiles its programs first."""
  graphdef, params = tiny_split
  prompt_BP, lens = pad_prompts([[3 + b, 4, 5] for b in range(5)])
  controller = runner.speculative_engine(graphdef, SuffixDrafter(num_draft=4))
  controller.host.use_factory(_WrongHostDrafter)
  settings = runner.Settings(max_new_tokens=24)
  runner.run_generation(controller, params, None, prompt_BP, lens, settings)
  compiles = []
  listener = lambda name, secs, **kw: compiles.append(name)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    state, _, _ = runner.run_generation(controller, params, None, prompt_BP, lens, settings)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert not [name for name in compiles if 'backend_compile' in name]
  assert int(jax.device_get(state.stats.steps_B).sum()) > 0


def test_the_benchmark_takes_the_controller_knobs_and_tree_shape(tmp_path):
  """`--config.controller.*` and `--config.tree.*` reach the benchmark's engines, as they
  reach the CLI's and the API's (they were once silently ignored)."""
  cfg = _tiny_cfg()
  cfg.bench.methods = ('ngram',)
  cfg.controller.ema, cfg.tree.num_nodes, cfg.tree.top_k = 0.5, 8, 2
  bench = harness.Benchmark(cfg, str(tmp_path), 'test')
  (drafter, _), = bench.drafters.values()
  settings = runner.Settings.from_config(cfg)
  auto = bench._engines('ngram', drafter, settings, 'auto').engine
  assert isinstance(auto, VerifyLengthController) and auto.config.ema == 0.5
  tree = bench._engines('ngram', drafter, settings, 'tree').engine
  assert tree.num_nodes == 8
