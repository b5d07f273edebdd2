"""scripts/bench_concurrency.py: several drafters against one AR baseline per batch size."""

import json
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

# Tiny shapes: 8 new tokens, two controller tiers, no timed repeats.
SMALL = ['--config=configs/tiny.py', '--tiers=0,3',
         '--config.max_new_tokens=8', '--config.timing_repeats=0',
         '--config.drafters.ngram.num_draft=3', '--config.drafters.oracle.num_draft=3']


def _run(out_dir, *args):
  return subprocess.run(
      [sys.executable, 'scripts/bench_concurrency.py', *SMALL, f'--out_dir={out_dir}', *args],
      cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_drafters_share_one_ar_baseline(tmp_path):
  proc = _run(tmp_path, '--drafter=ngram,oracle', '--concurrency=1,2', '--gammas=3')
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = json.loads((tmp_path / 'concurrency.json').read_text())
  rows = out['rows']
  assert {(r['method'], r['concurrency']) for r in rows} == {
      (m, b) for m in ('ar', 'ngram γ=3', 'ngram controller', 'oracle γ=3',
                       'oracle controller') for b in (1, 2)}
  for r in rows:
    assert r['lossless'] is True, r
    assert r['new_tokens'] == 8 * r['concurrency'] and r['tokens_per_s'] > 0
    assert r['decode_s_rounds'] == [r['decode_s']]   # no timed repeats: the warm-up's time
    if r['method'] == 'ar':
      assert r['speedup'] == 1.0 and r['tau'] == 1.0 and r['verified_per_committed'] == 1.0
    if r['verify_length'] == 'auto':
      assert r['num_draft'] == 3 and set(r['step_costs_ms']) == {'0', '3'}
      assert abs(sum(r['tier_usage'].values()) - 1.0) < 0.01
  oracle = [r for r in rows if r['drafter'] == 'oracle' and r['verify_length'] == 'fixed']
  assert all(r['tau'] > 1.0 for r in oracle)   # the oracle's drafts are accepted
  # γ=3 verifies at most 4 positions per step and commits τ of them.
  assert all(1.0 < r['verified_per_committed'] <= 4 / r['tau'] + 1e-9 for r in oracle)
  assert set(out['goals']) == {'ngram', 'oracle'}
  assert out['tiers'] == {'ngram': [0, 3], 'oracle': [0, 3]}
  for g in out['goals'].values():
    assert g['controller_vs_ar_min'] > 0 and g['smallest_concurrency'] == 1
  text = (tmp_path / 'concurrency.md').read_text()
  assert '| oracle controller |' in text and 'oracle: controller / AR' in text
  assert 'Positions verified per committed token' in text
  assert (tmp_path / 'concurrency.png').stat().st_size > 0


def _random_dflash(path):
  """A random DFlash drafter for the tiny target, trained block 4 (γ at most 3)."""
  from flax import nnx
  from configs import common
  from dspec.models import dflash
  from dspec.models.config import TransformerConfig
  target_cfg = TransformerConfig(**common.MODEL_PRESETS['tiny'])
  cfg = dflash.DFlashConfig.create(target_cfg.num_layers, num_layers=1, block_size=4,
                                   mask_token_id=1)
  dflash.save_dflash(str(path), dflash.DFlashModel(cfg, target_cfg, rngs=nnx.Rngs(0)))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sampled_run_with_a_learned_drafter(tmp_path):
  _random_dflash(tmp_path / 'dflash')
  proc = _run(tmp_path / 'out', '--drafter=dflash', '--concurrency=1', '--gammas=3,7',
              f'--config.drafters.dflash.path={tmp_path / "dflash"}',
              '--config.temperature=1.0', '--config.top_p=0.9')
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = json.loads((tmp_path / 'out' / 'concurrency.json').read_text())
  assert out['temperature'] == 1.0 and out['top_p'] == 0.9
  # dflash γ=7 is past its trained block: the drafter's own check refuses it.
  assert [r['method'] for r in out['rows']] == ['ar', 'dflash γ=3', 'dflash controller']
  assert 'block' in out['skipped']['dflash γ=7'] or '3' in out['skipped']['dflash γ=7']
  assert out['tiers'] == {'dflash': [0, 3]}
  assert all(r['lossless'] is None for r in out['rows'])
  assert 'not checked at T > 0' in (tmp_path / 'out' / 'concurrency.md').read_text()


# Not marked multiprocess: the module's test in the quick check (tests/conftest.py).
def test_unknown_drafter_is_one_line(tmp_path):
  proc = _run(tmp_path, '--drafter=ngram,bogus')
  assert proc.returncode == 1
  lines = proc.stderr.strip().splitlines()
  assert lines[-1].startswith('error: unknown drafter ') and 'bogus' in lines[-1]
  assert 'Traceback' not in proc.stderr
