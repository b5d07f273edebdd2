"""Self-distillation writes complete shards only, resumes, and masks target-written tokens;
the token map of a distilled dataset ranks the written tokens."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from conftest import REPO_ROOT
from configs import distill_demo
from dspec import checkpoint
from dspec.models.config import TransformerConfig
from dspec.models.draft_vocab import frequent_tokens
from dspec.models.transformer import Transformer
from dspec.training import distill


@pytest.fixture(scope='module')
def tiny_cfg():
  return distill_demo.get_config('tiny')   # data_dir: the repo's data/


@pytest.mark.slow
def test_distill_resumes_and_masks_target_tokens(tiny_cfg, tmp_path):
  out = str(tmp_path / 'd')
  first = distill.distill(tiny_cfg, out)
  data = distill.load_distilled(out)
  n = first['num_prompts']
  assert data['tokens'].shape[0] == n and first['complete']
  written = data['loss_mask'].sum(axis=1)
  assert np.all(written >= 1) and np.all(written <= tiny_cfg.distill.max_new_tokens)
  # Loss-masked tokens are a contiguous suffix of each row's valid tokens.
  for row_mask, length in zip(data['loss_mask'], data['lengths']):
    idx = np.flatnonzero(row_mask)
    assert idx[-1] == length - 1 and np.all(np.diff(idx) == 1)

  # Simulate a crash after the first shard: a stray temp file, manifest lists one shard.
  manifest_path = os.path.join(out, 'manifest.json')
  with open(manifest_path) as f:
    manifest = json.load(f)
  dropped = manifest['shards'][1:]
  for name in dropped:
    os.remove(os.path.join(out, name))
  manifest.update(shards=manifest['shards'][:1], complete=False)
  with open(manifest_path, 'w') as f:
    json.dump(manifest, f)
  open(os.path.join(out, 'shard_00001.npz.tmp.npz'), 'wb').write(b'partial')
  assert distill.load_distilled(out)['tokens'].shape[0] < n
  resumed = distill.distill(tiny_cfg, out)
  again = distill.load_distilled(out)
  assert resumed['complete'] and again['tokens'].shape[0] == n
  np.testing.assert_array_equal(again['tokens'], data['tokens'])


@pytest.mark.slow
def test_distill_refuses_a_dataset_made_with_other_settings(tiny_cfg, tmp_path):
  out = str(tmp_path / 'd')
  distill.distill(tiny_cfg, out)
  other = distill_demo.get_config('tiny')
  other.data_dir = tiny_cfg.data_dir
  other.distill.max_new_tokens = 5
  with pytest.raises(ValueError, match='other settings'):
    distill.distill(other, out)


def test_load_distilled_missing_dir_is_clear(tmp_path):
  with pytest.raises(FileNotFoundError, match='distill'):
    distill.load_distilled(str(tmp_path / 'nope'))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_token_map_script_ranks_written_tokens(tiny_cfg, tmp_path):
  """scripts/token_map.py writes the ids a reduced draft head would train on, and keeps an
  existing file."""
  out = str(tmp_path / 'd')
  distill.distill(tiny_cfg, out)
  target_cfg = TransformerConfig(**tiny_cfg.model.shape)
  checkpoint.save_model(str(tmp_path / 'target'), Transformer(target_cfg, rngs=nnx.Rngs(0)),
                        kind='target', config=target_cfg.to_dict())
  token_map = tmp_path / 'map.json'
  args = [sys.executable, os.path.join(REPO_ROOT, 'scripts', 'token_map.py'), f'--data={out}',
          '--size=5', f'--out={token_map}', f'--target={tmp_path / "target"}']
  proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  data = distill.load_distilled(out)
  expected = frequent_tokens(data['tokens'], data['loss_mask'], 5, target_cfg.vocab_size)
  assert json.loads(token_map.read_text()) == list(expected)
  assert 'wrote 5 token ids' in proc.stdout

  token_map.write_text('mine')
  proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1 and 'Traceback' not in proc.stderr
  assert [line for line in proc.stderr.splitlines() if line.startswith('error: ')] == \
      [f'error: --out={token_map}: exists and was not written by dspec; refusing to '
       'replace it (pass --force to replace it)']
  assert token_map.read_text() == 'mine'


def test_split_holds_out_rows_from_every_prompt_set_and_batches_epochs():
  # 60 "gsm8k" rows then 40 "code" rows, as distill_demo writes them: the held-out rows
  # must cover both, and training batches walk whole epochs of the rest.
  n, width = 100, 6
  tokens = np.arange(n * width, dtype=np.int32).reshape(n, width)
  domain = np.array([0] * 60 + [1] * 40)
  rows = distill.split_distilled({'tokens': tokens, 'loss_mask': tokens > 0}, width,
                                 heldout_fraction=0.1, eval_windows=6)
  held = [int(t[0]) // width for t in rows.held_tokens]
  assert len(held) == 6 and set(domain[held]) == {0, 1}
  assert rows.num_train == 90 and not set(held) & set(rows.train_rows.tolist())
  seen = [int(t[0]) // width for step in range(9)
          for t in rows.batch(step, seed=3, batch_size=10)['tokens']]
  assert sorted(seen) == sorted(rows.train_rows.tolist())   # epoch 0: each row once
  again = rows.batch(4, seed=3, batch_size=10)['tokens']
  np.testing.assert_array_equal(again, rows.batch(4, seed=3, batch_size=10)['tokens'])
  straddle = [int(t[0]) // width for t in rows.batch(8, seed=3, batch_size=15)['tokens']]
  assert len(straddle) == 15      # steps 120..134: the end of epoch 1, start of epoch 2
