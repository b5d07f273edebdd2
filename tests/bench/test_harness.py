"""Benchmark harness: the tiny config end to end, atomic outputs, SOL bound, datasets."""

import json
import math
import os

import pytest

from configs import bench_demo, bench_tiny
from dspec.bench import harness, report, sol

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


def test_interrupted_run_removes_stale_results(tmp_path, monkeypatch):
  report.write_json_atomic(str(tmp_path / report.RESULTS), [{'stale': True}])

  def interrupted(self, *args):
    raise KeyboardInterrupt

  monkeypatch.setattr(harness.Benchmark, 'run_sweep_point', interrupted)
  with pytest.raises(KeyboardInterrupt):
    harness.run_benchmark(_tiny_cfg(), str(tmp_path))
  assert not os.path.exists(tmp_path / report.RESULTS)


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
  cfg.drafters.mtp.path = ''
  assert 'mtp' in harness.plan_methods(cfg)[1], 'a method without a checkpoint is skipped'
