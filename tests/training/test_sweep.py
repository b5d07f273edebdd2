"""A sweep trains every variant with its overrides, resumes, and tabulates held-out metrics."""

import json
import os

import pytest

from configs import distill_demo, mtp_ablation
from dspec.checkpoint import read_model_metadata
from dspec.training import distill, sweep

def test_variant_config_applies_overrides_and_rejects_unknown_keys():
  base = mtp_ablation.get_config('tiny')
  cfg = sweep.variant_config(base, (('mtp.concat_order', 'hidden_first'),
                                    ('training.mtp_beta', 1.0)))
  assert cfg.mtp.concat_order == 'hidden_first' and cfg.training.mtp_beta == 1.0
  assert base.mtp.concat_order == 'emb_first'   # the base is untouched
  with pytest.raises(ValueError, match='no .concat_ordr'):
    sweep.variant_config(base, (('mtp.concat_ordr', 'x'),))
  with pytest.raises(ValueError, match='no .mpt'):
    sweep.variant_config(base, (('mpt.kind', 'x'),))


@pytest.mark.slow
def test_tiny_mtp_sweep_trains_each_variant_and_writes_the_table(tmp_path):
  dcfg = distill_demo.get_config('tiny')
  data_dir = str(tmp_path / 'distilled')
  distill.distill(dcfg, data_dir)
  cfg = mtp_ablation.get_config('tiny')
  cfg.data.path = data_dir
  out = str(tmp_path / 'sweep')
  metrics = cfg.sweep.metrics
  rows = sweep.run_sweep(cfg, cfg.sweep.variants, out, metrics)
  assert [r['variant'] for r in rows] == ['base', 'hidden_first']
  for r in rows:
    assert r['step'] == cfg.training.num_steps
    assert 0.0 <= r['agree_d1'] <= 1.0 and 1.0 <= r['tau_est'] <= 4.0
  saved = read_model_metadata(os.path.join(out, 'hidden_first', 'final'), 'mtp')
  assert saved['config']['mtp']['concat_order'] == 'hidden_first'
  assert json.load(open(os.path.join(out, 'results.json'))) == rows
  table = open(os.path.join(out, 'results.md')).read()
  assert 'mtp.concat_order=hidden_first' in table and '(base)' in table
  # Rerunning resumes: nothing retrains and the table is the same.
  assert sweep.run_sweep(cfg, cfg.sweep.variants, out, metrics, only=['base']) == rows
  with pytest.raises(ValueError, match='unknown sweep variants'):
    sweep.run_sweep(cfg, cfg.sweep.variants, out, metrics, only=['nope'])
