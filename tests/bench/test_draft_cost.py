"""scripts/bench_draft_cost.py: draft and verify passes timed in one process."""

import json
import subprocess
import sys

from conftest import REPO_ROOT


def test_draft_cost_cli_on_a_tiny_target(tmp_path):
  out = tmp_path / 'cost.json'
  proc = subprocess.run(
      [sys.executable, 'scripts/bench_draft_cost.py', '--config=configs/tiny.py',
       '--random_dflash_layers=1', '--random_dflash_vocab=64', '--repeats=3',
       '--config.max_new_tokens=8', f'--out={out}'],
      cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads(out.read_text())
  assert result['num_draft'] == 15 and result['batch_size'] == 1
  assert result['propose_s'] > 0 and result['verify_s'] > 0
  assert result['draft_over_verify'] >= result['propose_over_verify'] > 0
  assert 'draft/verify = ' in proc.stdout


def test_draft_cost_cli_bad_drafter_is_one_line(tmp_path):
  proc = subprocess.run(
      [sys.executable, 'scripts/bench_draft_cost.py', '--config=configs/tiny.py',
       '--config.drafter=dflash'],
      cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1].startswith('error: ')
  assert 'Traceback' not in proc.stderr
