"""`scripts/export_drafter.py` for the learned drafters written in speculators form: a
dspec DSpark / EAGLE-3 checkpoint exports (kind read from its metadata), loads back in
dspec from the exported directory and drafts the same logits (and DSpark confidences,
with the calibration kept); bad input is one `error:` line and exit status 1."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import REPO_ROOT, TINY
from dspec import checkpoint
from dspec.models import dspark
from dspec.models.eagle3 import Eagle3Config, Eagle3Model, save_eagle3
from dspec.models.formats import DRAFTERS, kind_of, load_dspark, load_eagle3
from dspec.models.transformer import Transformer

EXPORT = os.path.join(REPO_ROOT, 'scripts', 'export_drafter.py')
BLOCK = 4


def _export(*args):
  proc = subprocess.run([sys.executable, EXPORT, *map(str, args)], cwd=REPO_ROOT,
                        capture_output=True, text=True, timeout=300)
  return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope='module')
def target():
  return Transformer(TINY, rngs=nnx.Rngs(0))


@pytest.fixture(scope='module')
def dspark_ckpt(target, tmp_path_factory):
  """A random dspec DSpark checkpoint (rnn head, non-zero W2, calibrated) and its model."""
  cfg = dspark.DSparkConfig.create(TINY.num_layers, num_layers=1, block_size=BLOCK,
                                   mask_token_id=63, target_layer_ids=(0,), markov_rank=6,
                                   markov_head_type='rnn',
                                   confidence_temperatures=(1.5, 2.0, 0.5, 1.0))
  model = dspark.DSparkModel(cfg, TINY, rngs=nnx.Rngs(1))
  w2 = model.markov_head.markov_w2.kernel
  w2[...] = jax.random.normal(jax.random.key(2), w2.shape)
  path = tmp_path_factory.mktemp('dspark') / 'ckpt'
  checkpoint.save_model(path, model, kind='dspark',
                        config={'dspark': cfg.to_dict(), 'target': TINY.to_dict()})
  return path, model


def _dspark_draft(model, target, tokens_1S, anchor):
  """(biased draft logits, confidence logits) of the block anchored at `anchor`, teacher
  forced on the following tokens (context = positions < anchor)."""
  s = tokens_1S.shape[1]
  out = target(tokens_1S, taps=model.cfg.target_layer_ids, compute_logits=False)
  ctx_k, ctx_v = model.context_kv(model.fuse(out.taps_BTND, target), jnp.arange(s)[None])
  block = jnp.full((1, BLOCK), model.cfg.mask_token_id, jnp.int32).at[0, 0].set(
      tokens_1S[0, anchor])
  offsets = jnp.array([[anchor, BLOCK]], jnp.int32)
  hidden = model(target.embed(block), anchor + jnp.arange(BLOCK)[None], ctx_k, ctx_v,
                 model.cfg.draft_masks(BLOCK), offsets)
  return model.heads(target, hidden, tokens_1S[:, anchor:anchor + BLOCK])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_dspark_checkpoint_exports_to_speculators_and_drafts_the_same(
    dspark_ckpt, target, tmp_path):
  path, model = dspark_ckpt
  rc, stdout, stderr = _export(f'--path={path}', f'--out={tmp_path / "spec"}')
  assert rc == 0, stderr
  assert 'dspark drafter in speculators form' in stdout
  back = load_dspark(tmp_path / 'spec', num_target_layers=TINY.num_layers)
  assert back.cfg.confidence_temperatures == model.cfg.confidence_temperatures
  assert back.cfg.markov_head_type == 'rnn'
  tokens = jax.random.randint(jax.random.key(3), (1, 14), 0, TINY.vocab_size - 1)
  want_logits, want_conf = _dspark_draft(model, target, tokens, 7)
  logits, conf = _dspark_draft(back, target, tokens, 7)
  assert float(jnp.std(want_logits[..., 1:, :] - want_logits[..., :1, :])) > 0.1
  np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), atol=1e-5)
  np.testing.assert_allclose(np.asarray(conf), np.asarray(want_conf), atol=1e-5)


def test_the_script_s_registry_exports_and_reloads_an_eagle3_checkpoint(tmp_path):
  """The quick check's export, in this process: the calls the script makes (the kind read
  from the checkpoint, its speculators writer), and the written directory loads back with
  the same config and weights."""
  vocab = tuple(range(0, 64, 3))
  cfg = Eagle3Config(target_layer_ids=(1, 0, 1), final_tap_normed=True, draft_vocab=vocab)
  model = Eagle3Model(cfg, TINY, rngs=nnx.Rngs(4))
  save_eagle3(tmp_path / 'ckpt', model)
  kind = kind_of(str(tmp_path / 'ckpt'))
  assert kind == 'eagle3' and 'speculators' in DRAFTERS[kind].writers
  DRAFTERS[kind].writers['speculators'](str(tmp_path / 'spec'),
                                        DRAFTERS[kind].load(str(tmp_path / 'ckpt')),
                                        dtype='float32', force=False)
  back = load_eagle3(tmp_path / 'spec', target_cfg=TINY)
  assert back.cfg.draft_vocab == vocab
  want, got = (nnx.to_pure_dict(nnx.state(m, nnx.Param)) for m in (model, back))
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_eagle3_checkpoint_exports_to_speculators_and_drafts_the_same(target, tmp_path):
  vocab = tuple(sorted(set(range(0, 64, 2)) | set(range(1, 20, 2))))   # a reduced head
  cfg = Eagle3Config(target_layer_ids=(1, 0, 1), final_tap_normed=True, draft_vocab=vocab)
  model = Eagle3Model(cfg, TINY, rngs=nnx.Rngs(4))
  model.init_head_from(target)
  for layer in model.layers:
    layer.mlp.down_proj.kernel[...] *= 10.0
  save_eagle3(tmp_path / 'ckpt', model)
  rc, stdout, stderr = _export(f'--path={tmp_path / "ckpt"}', f'--out={tmp_path / "spec"}',
                               '--format=speculators')
  assert rc == 0, stderr
  assert 'eagle3 drafter in speculators form' in stdout
  back = load_eagle3(tmp_path / 'spec', target_cfg=TINY)
  assert back.cfg.draft_vocab == model.cfg.draft_vocab
  tokens = np.random.default_rng(0).integers(0, 64, (1, 13)).astype(np.int32)
  taps = target(tokens[:, :12], taps=model.cfg.target_layer_ids).taps_BTND
  want = model.ttt_logits(target, model.fuse(taps, target), tokens, 3)
  got = back.ttt_logits(target, back.fuse(taps, target), tokens, 3)
  for w, g in zip(want, got):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_bad_input_is_one_error_line(dspark_ckpt, target, tmp_path):
  path, _ = dspark_ckpt
  checkpoint.save_model(tmp_path / 'target', target, kind='target', config=TINY.to_dict())
  (tmp_path / 'full').mkdir()
  (tmp_path / 'full' / 'x').write_text('x')
  cases = [
      ([f'--path={tmp_path / "target"}'], "holds a 'target' model; export_drafter writes "
                                          'dflash, dflash2, dspark, eagle3, mtp drafters'),
      ([f'--path={path}', '--format=zlab'], 'dspec writes dspark drafters in speculators '
                                            'form only'),
      ([f'--path={tmp_path / "nowhere"}'], 'no such drafter directory'),
  ]
  for args, message in cases:
    rc, _, stderr = _export(*args, f'--out={tmp_path / "out"}')
    assert rc == 1 and stderr.strip().splitlines() == [stderr.strip()], stderr
    assert stderr.startswith('error: ') and message in stderr, stderr
    assert not (tmp_path / 'out').exists()
  rc, _, stderr = _export(f'--path={path}', f'--out={tmp_path / "full"}')
  assert rc == 1 and stderr.strip() == (
      f'error: --out={tmp_path / "full"}: directory holds files dspec did not write (\'x\', '
      '...); use a new directory (or pass --force to write into it; nothing in it is deleted)')
