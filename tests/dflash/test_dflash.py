"""DFlash drafter: masks, label alignment, context leaks, cached drafting, losslessness, CLI.

One toy target (tiny shape, 256-token vocab so the byte tokenizer fits the CLI) and one
drafter trained through the registered 'dflash' task on the target's own greedy
continuation of PROMPT, in the self-distilled data format.
"""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import REPO_ROOT, TINY, generate
from lossless_checks import check_engine_samples_match_target
from configs import dflash_demo
from dspec import checkpoint
from dspec.decoding.drafter import TruncatedDrafter
from dspec.decoding.drafters import registry
from dspec.decoding.drafters import dflash as dflash_drafters
from dspec.decoding.engine import SpeculativeEngine
from dspec.decoding.prompts import pad_prompts
from dspec.sampling import SamplingSpec
from dspec.decoding.state import DraftContext
from dspec.models.dflash import (BD3LMContextMask, DFlashConfig, DFlashModel,
                                 default_target_layer_ids)
from dspec.models.draft_vocab import frequent_tokens
from dspec.models.formats.dflash import load_dflash
from dspec.models.transformer import Transformer
from dspec.training import dflash_task, tasks
from pallas_kernels.block_attention import DFlashDraftMask, DFlashTrainMask

TOY = dataclasses.replace(TINY, vocab_size=256)
PROMPT = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
OTHER = [9, 9, 1]
NEW_TOKENS = 40


def _matrix(text):
  return np.array([[c == '1' for c in row] for row in text.split()], bool)


@pytest.fixture(scope='module')
def toy(tmp_path_factory):
  """Toy target saved as a checkpoint, its greedy continuation, and a trained drafter."""
  root = tmp_path_factory.mktemp('dflash')
  target = Transformer(TOY, rngs=nnx.Rngs(0))
  target.lm_head[...] = target.lm_head[...] * 20.0   # varied, tie-free greedy outputs
  graphdef, params = nnx.split(target)
  continuation = generate(SpeculativeEngine(graphdef), params, None, [PROMPT],
                          NEW_TOKENS)[0][0]
  target_dir = str(root / 'target')
  checkpoint.save_model(target_dir, target, kind='target', config=TOY.to_dict())

  data_dir = root / 'data'
  data_dir.mkdir()
  seq = np.array([PROMPT + continuation], np.int32)
  np.savez(data_dir / 'shard_00000.npz', tokens=seq,
           loss_mask=np.arange(seq.shape[1])[None] >= len(PROMPT),
           lengths=np.array([seq.shape[1]], np.int32))
  (data_dir / 'manifest.json').write_text(json.dumps({'shards': ['shard_00000.npz'],
                                                      'complete': True}))
  cfg = dflash_demo.get_config('tiny')
  cfg.model.source, cfg.model.path = 'checkpoint', target_dir
  cfg.data.path, cfg.data.heldout_fraction = str(data_dir), 0.0
  cfg.dflash.num_anchors = 16
  cfg.dflash.draft_vocab_size = 64   # a reduced head (covers every written token here)
  cfg.training.update(num_steps=60, batch_size=4, seq_len=seq.shape[1], learning_rate=1e-2,
                      log_every=60, eval_every=60, ckpt_every=60)
  result = tasks.run_training(cfg, str(root / 'run'))
  cfg.drafters.dflash.path = str(root / 'run' / 'final')
  drafter, dparams = registry.build_drafter(cfg, target)
  return dict(target=target, graphdef=graphdef, params=params, continuation=continuation,
              seq=seq, cfg=cfg, target_dir=target_dir, drafter=drafter, dparams=dparams,
              result=result)


# ------------------------------------------------------------------------------ masks


def test_default_taps_follow_the_reference():
  assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
  assert default_target_layer_ids(8, 3) == (1, 3, 5)
  assert default_target_layer_ids(8, 1) == (4,)
  assert default_target_layer_ids(2, 2) == (0, 1)


def test_training_mask_layout():
  # S = 4 context keys, then blocks of B = 2; anchors 2, 0 and an invalid block.
  mask = DFlashTrainMask(block_size=2, context_len=4)
  expected = _matrix('''
      1100110000
      1100110000
      0000001100
      0000001100
      0000000000
      0000000000''')
  np.testing.assert_array_equal(mask.dense(6, 10, np.array([[2, 0, -1]])), expected)
  window = DFlashTrainMask(block_size=2, context_len=4, window=2)
  np.testing.assert_array_equal(window.dense(2, 6, np.array([[3]])),
                                _matrix('001011\n001011'))


def test_drafting_mask_layout():
  # Cache capacity C = 5 with 3 valid entries, then a block of 3 (bidirectional).
  expected = _matrix('11100111\n11100111\n11100111')
  np.testing.assert_array_equal(DFlashDraftMask(block_size=3).dense(3, 8, 3), expected)
  windowed = _matrix('00100111\n00100111\n00100111')
  np.testing.assert_array_equal(DFlashDraftMask(block_size=3, window=2).dense(3, 8, 3),
                                windowed)


def test_bd3lm_context_mask_layout():
  # L = 4, B = 2: KV = [x_t | x_0 = injected context]; block b sees x_0 blocks < b.
  expected = _matrix('11000000\n11000000\n00111100\n00111100')
  np.testing.assert_array_equal(BD3LMContextMask(block_size=2, seq_len=4).dense(4, 8),
                                expected)


# ------------------------------------------------------------------ training objective


@pytest.fixture(scope='module')
def block_ce(toy):
  """(jit(taps, tokens, anchors) -> per-block summed CE, target taps, drafter) for a
  random 2-layer drafter (untrained, so its loss reacts to every visible input)."""
  cfg = DFlashConfig.create(TOY.num_layers, num_layers=2, block_size=4, mask_token_id=255)
  drafter = DFlashModel(cfg, TOY, rngs=nnx.Rngs(7))
  target = toy['target']
  loss_mask = jnp.ones(toy['seq'].shape, bool)

  @jax.jit
  def fn(taps, tokens, anchors):
    terms = dflash_task.dflash_terms(drafter, target, taps, tokens, loss_mask, anchors, 4.0)
    return jnp.sum(terms['ce'] * terms['valid'], axis=-1)[0]

  taps = dflash_task.target_taps(target, jnp.asarray(toy['seq']),
                                 drafter.cfg.target_layer_ids)
  return fn, taps, drafter


@pytest.mark.slow
def test_context_never_leaks_from_the_anchor_on(toy, block_ce):
  fn, taps, _ = block_ce
  tokens = jnp.asarray(toy['seq'])
  anchors = jnp.array([[12, 20, 30]])
  base = np.asarray(fn(taps, tokens, anchors))
  noise = jax.random.normal(jax.random.key(1), taps.shape)
  later = np.asarray(fn(taps.at[:, 20:].add(noise[:, 20:]), tokens, anchors))
  np.testing.assert_allclose(later[:2], base[:2], rtol=1e-5, atol=1e-5)
  assert abs(later[2] - base[2]) > 1e-3
  just_before = np.asarray(fn(taps.at[:, 19].add(noise[:, 19]), tokens, anchors))
  assert abs(just_before[1] - base[1]) > 1e-3
  # Blocks never see each other: another block's anchor token changes nothing here.
  other = np.asarray(fn(taps, tokens.at[0, 30].set(200), anchors))
  np.testing.assert_allclose(other[:2], base[:2], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_bd3lm_objective(toy, block_ce):
  """Noise in range with clean block starts; at t = 1 the CE equals DFlash at anchors kB."""
  _, taps, drafter = block_ce
  t, drop = dflash_task.bd3lm_noise(jax.random.key(0), 8, 32, 4, 0.3, 0.9, keep_first=True)
  t = np.asarray(t)
  assert t.min() >= 0.3 and t.max() <= 0.9
  assert not np.asarray(drop)[:, ::4].any() and np.asarray(drop).any()
  big_b = drafter.cfg.block_size
  s = 12 * big_b
  tokens = jnp.asarray(toy['seq'][:, :s])

  @jax.jit
  def run(taps, tokens):
    drop = jnp.broadcast_to(jnp.arange(s) % big_b != 0, tokens.shape)
    ce_bd3, _ = dflash_task.bd3lm_terms(drafter, toy['target'], taps, tokens, drop)
    terms = dflash_task.dflash_terms(drafter, toy['target'], taps, tokens,
                                     jnp.ones_like(tokens, bool),
                                     jnp.arange(0, s, big_b)[None], 4.0)
    batch = {'tokens': tokens, 'loss_mask': jnp.arange(s)[None] >= len(PROMPT)}
    loss = dflash_task.bd3lm_loss(drafter, toy['target'], batch, jax.random.key(0),
                                  eps_min=0.25, eps_max=1.0, keep_first=True)[0]
    return ce_bd3.reshape(-1, big_b)[:, 1:], terms['ce'][0], loss

  ce_bd3, ce_dflash, loss = run(taps[:, :s], tokens)
  np.testing.assert_allclose(ce_bd3, ce_dflash, rtol=1e-4, atol=1e-4)
  assert np.isfinite(float(loss)) and float(loss) > 0


# --------------------------------------------------------------------------- drafting


@pytest.fixture(scope='module')
def ragged_run(toy):
  """Greedy AR and DFlash outputs (and final state) for the ragged batch [PROMPT, OTHER]."""
  ar = generate(SpeculativeEngine(toy['graphdef']), toy['params'], None, [PROMPT, OTHER],
                NEW_TOKENS)[0]
  engine = SpeculativeEngine(toy['graphdef'], drafter=toy['drafter'])
  outs, state = generate(engine, toy['params'], toy['dparams'], [PROMPT, OTHER], NEW_TOKENS)
  return ar, outs, state


@pytest.mark.slow
def test_trained_on_a_toy_sequence_drafts_it(toy, ragged_run):
  assert toy['result']['eval']['acc1'] > 0.95
  assert toy['result']['eval']['walk_tau'] > 2.0   # the decode walk, beside the estimate
  _, outs, state = ragged_run
  assert outs[0] == toy['continuation']
  accepted, proposed = int(state.stats.accepted_B[0]), int(state.stats.proposed_B[0])
  assert accepted >= 0.95 * proposed, (accepted, proposed)


def _cached_and_fresh(drafter, target, dparams, tokens_BL, num_tokens_B, cache):
  """The block hidden of `drafter` drafting from `cache`, and from the cache `init` makes
  out of one causal target pass over the whole buffer (it keeps positions < n − 1)."""

  @jax.jit
  def run(dparams, tokens_BL, num_tokens_B, cache):
    model = nnx.merge(drafter.graphdef, dparams)
    b = tokens_BL.shape[0]
    ctx = DraftContext(tokens_BL, num_tokens_B, remaining_B=jnp.full((b,), 99, jnp.int32))
    masks_BG = jnp.full((b, drafter.num_draft), drafter.config.mask_token_id, jnp.int32)
    cached = drafter.block_hidden(model, cache, target, ctx, masks_BG)
    out = target(tokens_BL, taps=drafter.taps, compute_logits=False)
    fresh_cache = drafter.init(dparams, target, ctx, out).cache
    return cached, drafter.block_hidden(model, fresh_cache, target, ctx, masks_BG)

  return run(dparams, tokens_BL, num_tokens_B, cache)


@pytest.mark.slow
def test_cached_drafting_equals_a_fresh_forward(toy, ragged_run):
  state = ragged_run[2]
  assert int(state.stats.accepted_B[0]) >= 4   # multi-token commits went through update
  cached, fresh = _cached_and_fresh(toy['drafter'], toy['target'], toy['dparams'],
                                    state.tokens_BL, state.num_tokens_B,
                                    state.drafter_state.cache)
  np.testing.assert_allclose(cached, fresh, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_tier0_steps_record_and_sync_catches_up(toy):
  """At the controller's tier 0 DFlash only records fused features (its cache stays at
  the prompt); `sync` then appends them, in γ + 1 windows or a wide trip first, and the
  cache drafts what a fresh forward over the committed tokens gives."""
  steps = 11     # behind by 11 > 2 (γ + 1) = 8: one 10-wide trip, then one of γ + 1
  prompt_BP, lens_B = pad_prompts([PROMPT, OTHER])
  for width in (0, 10):
    drafter = dataclasses.replace(toy['drafter'], catch_up_width=width)
    engine = SpeculativeEngine(toy['graphdef'], drafter=TruncatedDrafter(drafter, 0))
    state = engine.prefill(toy['params'], toy['dparams'], prompt_BP, lens_B,
                           max_new_tokens=NEW_TOKENS)
    prefilled_B = np.asarray(state.drafter_state.cache.lengths_B)   # run donates state
    state = engine.run(toy['params'], toy['dparams'], state, steps)
    dstate = state.drafter_state
    np.testing.assert_array_equal(dstate.cache.lengths_B, prefilled_B)
    sync = jax.jit(lambda dp, ds, tokens_BL, num_B: drafter.sync(
        dp, ds, toy['target'], DraftContext(tokens_BL, num_B)))
    synced = sync(toy['dparams'], dstate, state.tokens_BL, state.num_tokens_B)
    np.testing.assert_array_equal(synced.cache.lengths_B, prefilled_B + steps)
    np.testing.assert_array_equal(synced.cache.lengths_B, state.num_tokens_B - 1)
    cached, fresh = _cached_and_fresh(drafter, toy['target'], toy['dparams'],
                                      state.tokens_BL, state.num_tokens_B, synced.cache)
    np.testing.assert_allclose(cached, fresh, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_the_block_is_whole_whatever_the_budget_left(toy, ragged_run):
  """Decoding drafts as training did: the block keeps all its keys when one token is left
  (block attention is bidirectional, so a shorter block changes every slot). z-lab's
  shrinking block (`shrink_block`) is what differs."""
  drafter, target, state = toy['drafter'], toy['target'], ragged_run[2]

  @functools.partial(jax.jit, static_argnums=0)
  def hidden(d, dparams, dstate, remaining):
    ctx = DraftContext(state.tokens_BL, state.num_tokens_B,
                       remaining_B=jnp.full((2,), remaining, jnp.int32))
    masks_BG = jnp.full((2, d.num_draft), d.config.mask_token_id, jnp.int32)
    return d.block_hidden(nnx.merge(d.graphdef, dparams), dstate.cache, target, ctx,
                          masks_BG)

  full = hidden(drafter, toy['dparams'], state.drafter_state, 99)
  np.testing.assert_array_equal(hidden(drafter, toy['dparams'], state.drafter_state, 1),
                                full)
  shrinking = dataclasses.replace(drafter, shrink_block=True)
  np.testing.assert_allclose(hidden(shrinking, toy['dparams'], state.drafter_state, 99),
                             full, rtol=1e-5, atol=1e-5)
  assert not np.allclose(hidden(shrinking, toy['dparams'], state.drafter_state, 1), full,
                         atol=1e-3)


@pytest.mark.slow
def test_controller_tiers_score_only_their_prefix(toy, ragged_run):
  """A tier of g drafts (TruncatedDrafter) scores only the first g block slots, drafting
  exactly the first g tokens of the whole block's proposal."""
  drafter, target, state = toy['drafter'], toy['target'], ragged_run[2]
  ctx = DraftContext(state.tokens_BL, state.num_tokens_B,
                     remaining_B=jnp.full((2,), 99, jnp.int32))
  propose = jax.jit(lambda d, p, st: d.propose(p, st, target, ctx,
                                                jax.random.key(0)).tokens_BG, static_argnums=0)
  whole = np.asarray(propose(drafter, toy['dparams'], state.drafter_state))
  for g in (1, 3):
    tier = TruncatedDrafter(drafter, g)
    np.testing.assert_array_equal(
        np.asarray(propose(tier, toy['dparams'], state.drafter_state)), whole[:, :g])


@pytest.mark.slow
def test_greedy_lossless_against_ar(toy, ragged_run):
  ar, outs, state = ragged_run
  assert outs == ar
  # Batch 1, with a smaller inference block and two denoising steps.
  smaller = dataclasses.replace(toy['drafter'], num_draft=2, denoise_steps=2)
  engine = SpeculativeEngine(toy['graphdef'], drafter=smaller)
  outs, state = generate(engine, toy['params'], toy['dparams'], [PROMPT], NEW_TOKENS)
  assert outs[0] == toy['continuation']
  assert int(state.stats.accepted_B[0]) > 0


@pytest.mark.slow
def test_reduced_draft_vocabulary(toy):
  tokens = np.array([[5, 5, 7, 2, 2, 2]])
  written = np.array([[0, 1, 1, 0, 0, 1]], bool)
  assert frequent_tokens(tokens, written, 2, 10) == (2, 5)   # tie: 2 seen more
  assert frequent_tokens(tokens, written, 4, 10) == (0, 2, 5, 7)
  with pytest.raises(ValueError, match='draft_vocab_size'):
    frequent_tokens(tokens, written, 11, 10)

  trained = checkpoint.read_model_metadata(toy['cfg'].drafters.dflash.path, 'dflash')
  vocab = trained['config']['dflash']['draft_vocab']
  assert len(vocab) == 64 and set(toy['continuation']) <= set(vocab)
  # Drop one token the target writes: it can never be drafted, output is unchanged.
  dropped = toy['continuation'][5]
  module = load_dflash(toy['cfg'].drafters.dflash.path,
                       draft_vocab=tuple(i for i in vocab if i != dropped))
  ids = jnp.asarray(module.cfg.draft_vocab)
  hidden = jax.random.normal(jax.random.key(0), (1, 3, TOY.embed_dim))
  np.testing.assert_allclose(module.draft_logits(toy['target'], hidden),
                             toy['target'].logits(hidden)[..., ids], rtol=1e-6)
  np.testing.assert_array_equal(module.token_ids(module.draft_index(ids)), ids)
  assert int(module.draft_index(jnp.asarray(dropped))) == -1
  drafter, dparams = dflash_drafters.DFlashDrafter.create(module)
  engine = SpeculativeEngine(toy['graphdef'], drafter=drafter)
  outs, state = generate(engine, toy['params'], dparams, [PROMPT], NEW_TOKENS)
  assert outs[0] == toy['continuation']
  assert 0 < int(state.stats.accepted_B[0]) < int(state.stats.proposed_B[0])


@pytest.mark.slow
def test_sampled_output_matches_the_target(small_vocab_model):
  cfg = DFlashConfig.create(small_vocab_model.cfg.num_layers, num_layers=1, block_size=3,
                            mask_token_id=11)
  module = DFlashModel(cfg, small_vocab_model.cfg, rngs=nnx.Rngs(5))
  drafter, dparams = dflash_drafters.DFlashDrafter.create(module)
  graphdef, params = nnx.split(small_vocab_model)
  engine = SpeculativeEngine(graphdef, drafter=drafter, sampling=SamplingSpec(greedy=False))
  check_engine_samples_match_target(engine, small_vocab_model, params, dparams,
                                    [3, 1, 4, 1, 5, 9, 2, 6], temperature=1.0,
                                    num_samples=25_000, num_tokens=2)


@pytest.mark.slow
def test_mismatched_target_and_missing_path_are_clear_errors(toy):
  drafter = toy['drafter']
  for change, words in [({'embed_dim': 48}, 'width'), ({'vocab_size': 300}, 'vocab'),
                        ({'num_layers': 3}, 'taps')]:
    with pytest.raises(ValueError, match=words):
      drafter.check_target(dataclasses.replace(TOY, **change))
  cfg = dflash_demo.get_config('tiny')
  cfg.drafters.dflash.path = ''
  with pytest.raises(ValueError, match='drafters.dflash.path'):
    registry.build_drafter(cfg, toy['target'])
  with pytest.raises(ValueError, match=r'drafters.dflash.num_draft must be in \[1, '):
    drafter.with_num_draft(drafter.config.block_size)


@pytest.mark.slow
def test_a_drafter_loaded_against_another_target_warns_naming_both(toy, capsys):
  record = checkpoint.read_model_metadata(toy['cfg'].drafters.dflash.path, 'dflash')['extra']
  assert record['target_sha256'] == checkpoint.weights_fingerprint(toy['target'])
  assert record['target_source'] == f'checkpoint:{toy["target_dir"]}'
  capsys.readouterr()
  registry.build_drafter(toy['cfg'], toy['target'])
  assert 'warning' not in capsys.readouterr().err
  other = Transformer(TOY, rngs=nnx.Rngs(1))
  registry.build_drafter(toy['cfg'], other)
  err = capsys.readouterr().err
  assert err.startswith('warning: ') and toy['target_dir'] in err
  assert record['target_sha256'][:12] in err
  assert checkpoint.weights_fingerprint(other)[:12] in err


@pytest.mark.multiprocess
@pytest.mark.slow
def test_decode_cli_with_a_trained_drafter(toy, tmp_path):
  metrics = tmp_path / 'm.json'
  cmd = [sys.executable, os.path.join(REPO_ROOT, 'scripts', 'decode.py'),
         '--config=' + os.path.join(REPO_ROOT, 'configs', 'dflash_demo.py') + ':tiny',
         '--config.model.source=checkpoint', f'--config.model.path={toy["target_dir"]}',
         f'--config.drafters.dflash.path={toy["cfg"].drafters.dflash.path}',
         '--config.compare_ar=True', f'--config.max_new_tokens={NEW_TOKENS}',
         # τ of the drafter itself: the default controller picks tiers from wall timings
         '--config.verify_length=fixed',
         '--prompt_ids=' + ','.join(map(str, PROMPT)), f'--metrics_json={metrics}']
  result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert 'lossless=True' in result.stdout
  report = json.loads(metrics.read_text())
  assert report['method'] == 'dflash' and report['tau'] > 3.5
