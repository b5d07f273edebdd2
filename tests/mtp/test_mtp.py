"""Chained MTP: drafting = full causal pass, lossless decoding, training, CLI."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from conftest import REPO_ROOT, TINY, generate
from dspec.decoding.drafters import registry
from dspec.decoding.drafters.mtp import MTPDrafter
from dspec.decoding.engine import SpeculativeEngine
from dspec.sampling import SamplingSpec
from dspec.decoding.state import DraftContext
from dspec.models.config import TransformerConfig
from dspec.models.formats.mtp import load_mtp
from dspec.models.mtp import MTP, MTPConfig, save_mtp
from dspec.models.transformer import TargetOutput
from dspec.training import trainer
from dspec.training.distill import load_distilled
from dspec.training.mtp_task import JointModel, depth_weights, joint_loss, posthoc_task
from lossless_checks import check_engine_samples_match_target

PROMPTS = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [9]]   # ragged; [9] cannot draft at first
NEW_TOKENS = 20


def random_mtp(cfg: MTPConfig, target_cfg=TINY, seed=1, scale=10.0):
  """A random MTP whose blocks matter (larger MLP outputs than the 0.02 init gives)."""
  mtp = MTP(cfg, target_cfg, rngs=nnx.Rngs(seed))
  for depth in mtp.depths:
    depth.layer.mlp.down_proj.kernel[...] *= scale
  return mtp


# ---------------------------------------------------------------- drafting == full pass

CONSISTENCY = [
    (MTPConfig(num_depths=3), 0),
    (MTPConfig(num_depths=2, h0_source='pre_norm', chain_hidden='pre_norm',
               concat_order='hidden_first', zero_pos0_embedding=True, share_final_norm=True,
               shared_depth=True), 3),
    (MTPConfig(num_depths=2, kind='parallel'), 0),
]


@pytest.mark.slow
@pytest.mark.parametrize('cfg,num_draft', CONSISTENCY, ids=['chained', 'knobs', 'parallel'])
def test_catch_up_and_drafting_match_full_pass(tiny_model, cfg, num_draft):
  """After prefill and catch-ups with varied acceptance (garbage verify hidden at rejected
  slots), the logits of every depth at n-2 equal the full causal pass over the committed
  tokens followed by the earlier drafts. Idle updates (the controller's AR tier: record
  only) are caught up by `sync` before drafting, over more positions than one window."""
  target = tiny_model
  mtp = random_mtp(cfg)
  drafter, params = MTPDrafter.from_model(mtp, num_draft)
  rng = np.random.default_rng(0)
  b, length, gamma = 2, 40, 3
  seq = rng.integers(1, 64, (b, length)).astype(np.int32)
  full = jax.jit(lambda t, s: t(s, taps=drafter.taps))(target, seq)

  def ctx_of(tokens, n):
    tokens = jnp.where(jnp.arange(length)[None] < n[:, None], tokens, 0)
    return DraftContext(tokens, n, SamplingSpec(), jnp.float32(0), jnp.float32(1))

  init = jax.jit(lambda p, t, s, n, out: drafter.init(p, t, ctx_of(s, n), out))
  update, idle_update = (jax.jit(lambda p, st, t, s, n, out, start, a, fn=fn: fn(
      p, st, t, ctx_of(s, n), out, start, a)) for fn in (drafter.update, drafter.idle_update))
  sync = jax.jit(lambda p, st, t, s, n: drafter.sync(p, st, t, ctx_of(s, n)))
  draft = jax.jit(lambda p, st, t, s, n: drafter.draft(
      p, drafter.sync(p, st, t, ctx_of(s, n)), t, ctx_of(s, n), jax.random.key(0))[:2])

  @jax.jit
  def reference(m, t, h0_BLD, seq_BL, n_B):
    """Full causal pass over committed tokens + drafts (+ padding, which causality
    ignores); h0 at positions <= n-2 only depends on committed tokens."""
    outs = m(t, h0_BLD, seq_BL, num_depths=drafter.num_draft)
    rows = jnp.arange(seq_BL.shape[0])
    return jnp.stack([t.logits(o)[rows, n_B - 2] for o in outs], axis=1)

  n = np.array([5, 2], np.int32)
  w = n.max() - 1   # prefill covers positions 0..P-2; causal, so a slice of `full`
  pre = TargetOutput(None, full.hidden_BTD[:, :w], full.taps_BTND[:, :w], None)
  state = init(params, target, seq, n, pre)
  for accepted in [[2, 0], *['idle'] * 5, [0, 3], [3, 1], 'idle', [1, 2], None]:
    drafts, logits = draft(params, state, target, seq, n)
    with_drafts = np.zeros_like(seq)
    for r in range(b):
      row = np.concatenate([seq[r, :n[r]], np.asarray(drafts[r])])
      with_drafts[r, :len(row)] = row
    ref = reference(mtp, target, mtp.h0(full), jnp.asarray(with_drafts), jnp.asarray(n))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=1e-5, rtol=1e-5)
    if accepted is None:
      break
    a = np.zeros(b, np.int32) if accepted == 'idle' else np.array(accepted, np.int32)
    start = n - 1
    idx = start[:, None] + np.arange(gamma + 1)[None]
    rejected = np.arange(gamma + 1)[None] > a[:, None]
    noise = rng.normal(size=(b, gamma + 1, TINY.embed_dim)).astype(np.float32)
    hidden = np.where(rejected[..., None], noise,
                      np.asarray(full.hidden_BTD)[np.arange(b)[:, None], idx])
    taps = np.where(rejected[..., None, None], noise[:, :, None],
                    np.asarray(full.taps_BTND)[np.arange(b)[:, None], idx])
    lengths = np.asarray(state.cache.lengths_B)
    n = n + a + 1
    step = idle_update if accepted == 'idle' else update
    state = step(params, state, target, seq, n,
                 TargetOutput(None, jnp.asarray(hidden), jnp.asarray(taps), None),
                 jnp.asarray(start), jnp.asarray(a))
    want = lengths if accepted == 'idle' else n - 1    # an idle update only records
    assert np.asarray(state.cache.lengths_B).tolist() == want.tolist()
  assert np.asarray(sync(params, state, target, seq, n).cache.lengths_B).tolist() == \
      (n - 1).tolist()


# ------------------------------------------------------------------- greedy lossless


@pytest.fixture(scope='module')
def ar_outputs(tiny_split):
  engine = SpeculativeEngine(tiny_split[0])
  return (generate(engine, tiny_split[1], None, PROMPTS, NEW_TOKENS)[0],
          generate(engine, tiny_split[1], None, PROMPTS[:1], NEW_TOKENS)[0])


def check_greedy(tiny_split, ar_outputs, drafter, params):
  engine = SpeculativeEngine(tiny_split[0], drafter=drafter)
  outs, state = generate(engine, tiny_split[1], params, PROMPTS, NEW_TOKENS)
  assert outs == ar_outputs[0]
  assert generate(engine, tiny_split[1], params, PROMPTS[:1], NEW_TOKENS)[0] == ar_outputs[1]
  return state.stats


@pytest.mark.slow
@pytest.mark.parametrize('depths', [1, 3])
def test_greedy_random_mtp_equals_ar(tiny_split, ar_outputs, depths):
  drafter, params = MTPDrafter.from_model(random_mtp(MTPConfig(num_depths=depths)))
  stats = check_greedy(tiny_split, ar_outputs, drafter, params)
  assert int(np.asarray(stats.proposed_B).sum()) > 0


# ------------------------------------------------------------------------- training


@pytest.fixture(scope='module')
def distilled_dir(tmp_path_factory, tiny_split):
  """Greedy continuations of the tiny target in the scripts/distill.py format (batches
  shaped like PROMPTS, so the AR program compiled for `ar_outputs` is reused)."""
  rng = np.random.default_rng(0)
  engine = SpeculativeEngine(tiny_split[0])
  p, rows = len(PROMPTS[0]), 48
  prompts = rng.integers(1, 64, (rows, p)).astype(np.int32)
  tokens = np.zeros((rows, p + NEW_TOKENS), np.int32)
  loss_mask = np.zeros_like(tokens, bool)
  for i in range(0, rows, 2):
    outs, _ = generate(engine, tiny_split[1], None, prompts[i:i + 2].tolist(), NEW_TOKENS)
    for r, out in enumerate(outs):
      tokens[i + r] = list(prompts[i + r]) + out
      loss_mask[i + r, p:] = True
  path = tmp_path_factory.mktemp('distill')
  np.savez(path / 'shard_00000.npz', tokens=tokens, loss_mask=loss_mask,
           lengths=np.full((rows,), p + NEW_TOKENS, np.int32))
  (path / 'manifest.json').write_text(json.dumps({'shards': ['shard_00000.npz'],
                                                  'complete': True}))
  return str(path)


@pytest.fixture(scope='module')
def trained(tmp_path_factory, tiny_model, distilled_dir):
  """Post-hoc D=3 MTP on the tiny target's own outputs: (eval before, eval after, dir)."""
  tcfg = ml_collections.ConfigDict(dict(
      num_steps=100, batch_size=8, seq_len=29, learning_rate=1e-2, warmup_ratio=0.05,
      weight_decay=0.0, grad_clip=1.0, b1=0.9, b2=0.95, seed=0, log_every=100,
      eval_every=100, eval_windows=16, ckpt_every=1000, max_minutes=0.0,
      storage_dtype='float32', mtp_beta=0.6))
  task = posthoc_task(tiny_model, MTPConfig(num_depths=3), load_distilled(distilled_dir),
                      tcfg, heldout_fraction=0.25)
  before = task.evaluate(task.model, task.frozen)
  workdir = tmp_path_factory.mktemp('mtp_train')
  after = trainer.train(task, tcfg, str(workdir))['eval']
  return before, after, os.path.join(workdir, 'final')


@pytest.mark.slow
def test_posthoc_training_lowers_every_depth(trained):
  before, after, _ = trained
  for k in (1, 2, 3):
    assert after[f'loss_d{k}'] < before[f'loss_d{k}'] - 0.5, (before, after)
  assert after['agree_d1'] > before['agree_d1']


@pytest.mark.slow
def test_greedy_trained_mtp_equals_ar_and_accepts(tiny_split, ar_outputs, trained):
  drafter, params = MTPDrafter.from_model(load_mtp(trained[2]))
  stats = check_greedy(tiny_split, ar_outputs, drafter, params)
  assert int(np.asarray(stats.accepted_B).sum()) > 0


@pytest.mark.slow
def test_joint_step_trains_trunk_and_mtp(tiny_model):
  """Gradients reach the trunk; one SGD step lowers L_main + λ/D Σ L_k."""
  target = nnx.merge(*nnx.split(tiny_model))
  model = JointModel(target, MTP(MTPConfig(num_depths=2), TINY, rngs=nnx.Rngs(2)))
  graphdef, params = nnx.split(model)
  tokens = np.random.default_rng(1).integers(0, 64, (4, 17)).astype(np.int32)
  batch = {'tokens': jnp.asarray(tokens), 'mtp_lambda': jnp.float32(0.3)}
  weights = depth_weights(2, 1.0)

  @jax.jit
  def loss_and_grad(p):
    return jax.value_and_grad(
        lambda q: joint_loss(nnx.merge(graphdef, q), None, batch, None, weights=weights),
        has_aux=True)(p)

  (loss0, metrics), grads = loss_and_grad(params)
  assert float(jnp.abs(grads['target']['layers'][0]['mlp']['up_proj']['kernel'][...]).sum()) > 0
  assert float(jnp.abs(grads['mtp']['depths'][1]['eh_proj']['kernel'][...]).sum()) > 0
  expected = metrics['loss_main'] + 0.3 * (metrics['loss_d1'] + metrics['loss_d2']) / 2
  np.testing.assert_allclose(float(loss0), float(expected), rtol=1e-5)
  stepped = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
  (loss1, _), _ = loss_and_grad(stepped)
  assert float(loss1) < float(loss0)


# ------------------------------------------------------------------- sampled lossless


@pytest.mark.slow
@pytest.mark.parametrize('sampled,scale', [
    (False, 10.0),     # argmax proposals (one-hot q)
    (True, 10.0),      # sampled proposals with their q
    (True, 300.0),     # adversarial: very peaked, mostly wrong q (same program as above)
], ids=['argmax', 'sampled', 'adversarial'])
def test_sampled_lossless(small_vocab_model, sampled, scale):
  """D=2: the two tested tokens come from depths 1 and 2 (the joint covers both)."""
  graphdef, params = nnx.split(small_vocab_model)
  mtp = random_mtp(MTPConfig(num_depths=2), small_vocab_model.cfg, seed=int(scale),
                   scale=scale)
  drafter, dparams = MTPDrafter.from_model(mtp, sample_proposals=sampled)
  engine = SpeculativeEngine(graphdef, drafter=drafter, sampling=SamplingSpec(greedy=False))
  check_engine_samples_match_target(engine, small_vocab_model, params, dparams,
                                    [1, 5, 2, 7], temperature=1.0, num_samples=40_000)


# ------------------------------------------------------------------------ CLI, errors


def _tiny_preset_target_cfg():
  sys.path.insert(0, REPO_ROOT)
  from configs import common
  return TransformerConfig(**common.MODEL_PRESETS['tiny'])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_cli_decode_tiny_is_lossless(tmp_path):
  path = str(tmp_path / 'mtp')
  save_mtp(path, random_mtp(MTPConfig(num_depths=4), _tiny_preset_target_cfg()))
  out = subprocess.run(
      [sys.executable, 'scripts/decode.py', '--config=configs/mtp_demo.py:tiny',
       f'--config.drafters.mtp.path={path}', '--config.drafters.mtp.num_draft=2',
       '--config.compare_ar=True', '--prompt_ids=5,6,7,5,6'],
      cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert 'method=mtp' in out.stdout and 'lossless=True' in out.stdout, out.stdout


def test_registry_errors(tmp_path, tiny_model):
  sys.path.insert(0, REPO_ROOT)
  from configs import mtp_demo
  cfg = mtp_demo.get_config('tiny')
  with pytest.raises(ValueError, match='drafters.mtp.path'):
    registry.build_drafter(cfg, tiny_model)
  path = str(tmp_path / 'mtp')
  save_mtp(path, MTP(MTPConfig(num_depths=2, h0_source='pre_norm'),
                     _tiny_preset_target_cfg(), rngs=nnx.Rngs(0)))
  assert load_mtp(path).cfg.h0_source == 'pre_norm'
  cfg.drafters.mtp.path = path
  with pytest.raises(ValueError, match='width'):
    registry.build_drafter(cfg, tiny_model)
  cfg.drafters.mtp.num_draft = 3
  with pytest.raises(ValueError, match='exceeds the 2 trained depths'):
    registry.build_drafter(cfg, tiny_model)
  drafter, _ = MTPDrafter.from_model(MTP(MTPConfig(h0_source='pre_norm'), TINY,
                                         rngs=nnx.Rngs(0)))
  assert drafter.taps == (TINY.num_layers - 1,)
  with pytest.raises(ValueError, match='taps layer 1'):
    drafter.check_target(TransformerConfig(**dict(TINY.to_dict(), num_layers=3)))
