"""`scripts/plot_dspark_confidence.py` on a tiny random DSpark checkpoint: per-position
acceptance and calibrated confidence on the held-out distilled rows, written as a PNG and
JSON. The confidence head is a constant logit b, so every slot's calibrated confidence
is σ(b / T_k) exactly."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
from flax import nnx

from conftest import REPO_ROOT, TINY
from dspec import checkpoint
from dspec.models import dspark
from dspec.models.transformer import Transformer

TOY = dataclasses.replace(TINY, vocab_size=256)   # the byte tokenizer's ids
BLOCK = 3
TEMPS = (1.0, 2.0, 4.0)
BIAS = 1.5


# Not marked multiprocess: the module's test in the quick check (tests/conftest.py).
def test_plot_reports_acceptance_and_calibrated_confidence_per_position(tmp_path):
  target = Transformer(TOY, rngs=nnx.Rngs(0))
  checkpoint.save_model(tmp_path / 'target', target, kind='target', config=TOY.to_dict())
  cfg = dspark.DSparkConfig.create(TOY.num_layers, num_layers=1, block_size=BLOCK,
                                   mask_token_id=255, target_layer_ids=(0,), markov_rank=4,
                                   confidence_temperatures=TEMPS)
  model = dspark.DSparkModel(cfg, TOY, rngs=nnx.Rngs(1))
  proj = model.confidence_head.proj
  proj.kernel[...] = np.zeros(proj.kernel.shape, np.float32)
  proj.bias[...] = np.full(proj.bias.shape, BIAS, np.float32)
  checkpoint.save_model(tmp_path / 'dspark', model, kind='dspark',
                        config={'dspark': cfg.to_dict(), 'target': TOY.to_dict()})
  data = tmp_path / 'data'
  data.mkdir()
  seq = np.random.default_rng(0).integers(1, 250, (4, 32)).astype(np.int32)
  np.savez(data / 'shard_00000.npz', tokens=seq,
           loss_mask=np.arange(32)[None].repeat(4, 0) >= 8, lengths=np.full(4, 32, np.int32))
  (data / 'manifest.json').write_text(json.dumps({'shards': ['shard_00000.npz'],
                                                  'complete': True}))
  out = tmp_path / 'plot' / 'confidence.png'
  os.makedirs(out.parent)
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO_ROOT, 'scripts', 'plot_dspark_confidence.py'),
       '--config=configs/dspark_demo.py:tiny', '--config.model.source=checkpoint',
       f'--config.model.path={tmp_path / "target"}',
       f'--config.drafters.dspark.path={tmp_path / "dspark"}',
       f'--config.data.path={data}', '--config.data.heldout_fraction=0.5', f'--out={out}'],
      cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  assert out.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  report = json.loads(out.with_suffix('.json').read_text())
  assert report['blocks'] > 0 and len(report['valid_per_slot']) == BLOCK
  want = 1.0 / (1.0 + np.exp(-BIAS / np.asarray(TEMPS)))
  for mode in ('sampled', 'greedy'):   # no greedy temperatures: the sampled ones
    r = report[mode]
    np.testing.assert_allclose(r['confidence'], want, rtol=1e-5)
    np.testing.assert_allclose(r['predicted_survival'], np.cumprod(want), rtol=1e-5)
    assert len(r['acceptance']) == BLOCK and all(0.0 <= a <= 1.0 for a in r['acceptance'])
    assert 0.0 <= r['ece'] <= 1.0
    assert r['survival'][0] == r['acceptance'][0]   # S_1 = α_1
    assert r['survival'][-1] <= r['survival'][0]
  assert 'sampled: acceptance' in proc.stdout
