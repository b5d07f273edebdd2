"""scripts/bench_draft_cost.py: draft and verify passes timed in one process."""

import json
import subprocess
import sys

import pytest

from conftest import REPO_ROOT


@pytest.mark.multiprocess
@pytest.mark.slow
def test_draft_cost_cli_on_a_tiny_target_and_the_family_plot(tmp_path):
  out = tmp_path / 'cost.json'
  proc = subprocess.run(
      [sys.executable, 'scripts/bench_draft_cost.py', '--config=configs/tiny.py',
       '--random_dflash_layers=1', '--random_dflash_vocab=64', '--repeats=3',
       '--config.max_new_tokens=8', '--verify_curve=1,2,4', f'--out={out}'],
      cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads(out.read_text())
  assert result['num_draft'] == 15 and result['batch_size'] == 1
  assert result['propose_s'] > 0 and result['verify_s'] > 0
  assert result['draft_over_verify'] >= result['propose_over_verify'] > 0
  assert 'draft/verify = ' in proc.stdout
  curve = result['verify_curve']
  assert sorted(curve['over_ar_step']) == ['1', '2', '4'] and curve['over_ar_step']['1'] == 1
  assert result['draft_in_ar_steps'] > 0 and result['weight_read_s'] > 0
  assert 'verify k tokens / AR step: k=1 1.00, k=2 ' in proc.stdout

  # The τ-against-draft-time plot joins bench_trees rows and these costs by checkpoint.
  rows = [{'drafter': 'dflash', 'path': '', 'T': t, 'chain_tau': tau,
           'chain_slot_acceptance': [0.5, 0.25], 'trees': {'32x8': {'tau': 2.0}}}
          for t, tau in ((0.0, 1.75), (1.0, 1.25))]
  trees = tmp_path / 'trees.json'
  trees.write_text(json.dumps({'rows': rows}))
  png, table = tmp_path / 'family.png', tmp_path / 'family.md'
  proc = subprocess.run(
      [sys.executable, 'scripts/plot_tau_vs_draft.py', f'--trees={trees}', f'--costs={out}',
       f'--wide_ar={out}', f'--out={png}', f'--table={table}'],
      cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  line = [l for l in table.read_text().splitlines() if l.startswith('| dflash')][0]
  assert '| 1.75 | 2.00 | 1.25 | 0.50 0.25 |' in line, line
  in_ar_steps = f'{result["draft_in_ar_steps"]:.2f}'   # the same AR step twice here
  assert line.endswith(f'| {in_ar_steps} | {in_ar_steps} |'), line


# Not marked multiprocess: the module's test in the quick check (tests/conftest.py).
def test_draft_cost_cli_bad_drafter_is_one_line(tmp_path):
  proc = subprocess.run(
      [sys.executable, 'scripts/bench_draft_cost.py', '--config=configs/tiny.py',
       '--config.drafter=dflash'],
      cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1].startswith('error: ')
  assert 'Traceback' not in proc.stderr
