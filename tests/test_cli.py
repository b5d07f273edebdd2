"""`scripts/decode.py`: the docs/DESIGN.md CLI contract, including one-line errors for bad input."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

DECODE = os.path.join(REPO_ROOT, 'scripts', 'decode.py')


def _run(*args):
  proc = subprocess.run([sys.executable, DECODE, *args], cwd=REPO_ROOT, capture_output=True,
                        text=True, timeout=300)
  return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.multiprocess
@pytest.mark.slow
def test_metrics_json_has_every_design_key(tmp_path):
  out = tmp_path / 'm.json'
  rc, stdout, stderr = _run('--config=configs/tiny.py', '--prompt_ids=1,2,3,1,2,3,1,2',
                            '--config.drafter=ngram', '--config.compare_ar=True',
                            '--config.max_new_tokens=12', '--config.timing_repeats=1',
                            f'--metrics_json={out}')
  assert rc == 0, stderr
  report = json.loads(out.read_text())
  for key in ('method', 'temperature', 'new_tokens', 'tau', 'acceptance_rate',
              'per_position_acceptance', 'tokens_per_s', 'ar_tokens_per_s', 'speedup',
              'lossless', 'output_ids'):
    assert key in report, key
  assert report['method'] == 'ngram' and report['lossless'] is True
  assert report['speedup_rounds'] == [pytest.approx(report['speedup'])]   # one timed round
  assert len(report['output_ids']) == report['new_tokens'] == 12
  assert len(report['per_position_acceptance']) == 8
  assert 'lossless=True' in stdout


@pytest.mark.multiprocess
@pytest.mark.slow
def test_output_is_quiet_echoes_the_prompt_and_writes_a_trace(tmp_path):
  trace_path = tmp_path / 'trace.json'
  rc, stdout, stderr = _run('--config=configs/tiny.py', '--prompt=abcabcabc',
                            '--config.drafter=ngram', '--config.max_new_tokens=10',
                            '--config.timing_repeats=0', f'--trace_json={trace_path}')
  assert rc == 0, stderr
  assert stdout.startswith('prompt:\nabcabcabc\n----- continuation -----\n')
  assert not [line for line in stderr.splitlines() if line[:1] in 'IW' and line[1:5].isdigit()]
  phases = [line for line in stderr.splitlines() if line.startswith('[dspec')]
  assert any('loading' in p for p in phases) and any('decoding' in p for p in phases)
  trace = json.loads(trace_path.read_text())
  assert sum(len(s['committed']) for s in trace['steps']) == 9   # + the prefill's token
  rc, stdout, stderr = _run('--config=configs/tiny.py', '--prompt=abc', '--quiet')
  assert rc == 0 and not stderr.strip(), stderr


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize('old,new', [('drafters.ngram.draft_len', 'drafters.ngram.num_draft'),
                                     ('drafters.dflash.block_size', 'drafters.dflash.num_draft')])
def test_renamed_config_fields_name_the_new_one(old, new):
  rc, _, stderr = _run('--config=configs/tiny.py', f'--config.{old}=4')
  assert rc == 1 and stderr.strip().splitlines() == [
      f'error: config field {old} was renamed: use {new}' + (
          ' (= block size - 1)' if 'dflash' in old else '')]


BAD_INPUTS = {
    'empty_prompt': (['--prompt='], 'empty prompt'),
    'prompt_too_long': (['--config.model.max_seq_len=16', '--prompt_ids=' + ','.join(
        ['1'] * 10)], 'exceeds the model context'),
    'unknown_token_id': (['--prompt_ids=1,2,999'], 'out of range'),
    'negative_temperature': (['--config.temperature=-0.5'], 'temperature'),
    'top_p_zero': (['--config.top_p=0'], 'top_p'),
    'top_p_above_one': (['--config.top_p=1.5'], 'top_p'),
    'widen_mlp_zero': (['--config.model.widen_mlp=0'], 'model.widen_mlp must be in [1, '),
    'unknown_config_key': (['--config.bogus=1'], 'unknown config field bogus'),
    'wrong_config_type': (['--config.max_new_tokens=many'], 'max_new_tokens'),
    'unknown_drafter': (['--config.drafter=bogus'], 'unknown drafter'),
    'missing_checkpoint': (['--config.model.source=checkpoint',
                            '--config.model.path=/nonexistent/ckpt'], '/nonexistent/ckpt'),
}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize('case', list(BAD_INPUTS))
def test_bad_input_gets_one_clear_line(case, tmp_path):
  args, expected = BAD_INPUTS[case]
  out = tmp_path / 'm.json'
  rc, _, stderr = _run('--config=configs/tiny.py', f'--metrics_json={out}', *args)
  assert rc != 0
  assert 'Traceback' not in stderr
  errors = [line for line in stderr.splitlines() if line.startswith('error: ')]
  assert len(errors) == 1 and expected in errors[0], stderr[-2000:]
  assert not out.exists()


# Not marked multiprocess: the module's test in the quick check (tests/conftest.py).
def test_missing_config_file_is_one_line():
  rc, _, stderr = _run('--config=configs/no_such_config.py')
  assert rc != 0 and 'Traceback' not in stderr
  assert 'config file not found' in stderr
