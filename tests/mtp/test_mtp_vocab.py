"""MTP with a reduced draft vocabulary (FastMTP's vocabulary compression).

The depths score only `draft_vocab` (rows of the shared head): draft logits are the full
ones restricted to the subset, drafts are target ids inside it, and at T > 0 the q handed to
rejection sampling is over the full vocabulary with zeros outside the subset. Greedy output
equals AR and sampled output follows the target (chi-square on the first token and the
3-token joint). Post-hoc training picks the subset from the distilled written-token counts;
a token map restricts a full-vocabulary MTP when it is loaded.
"""

import json

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from conftest import TINY, generate, greedy_rows
from configs import common
from dspec.decoding.drafters import registry
from dspec.decoding.drafters.mtp import MTPDrafter
from dspec.decoding.engine import SpeculativeEngine
from dspec.models.draft_vocab import frequent_tokens
from dspec.models.formats.mtp import load_mtp
from dspec.models.mtp import MTP, MTPConfig, save_mtp
from dspec.sampling import SamplingSpec
from dspec.training import trainer
from dspec.training.mtp_task import build_joint_task, posthoc_task
from lossless_checks import check_engine_samples_match_target

PROMPTS = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [9, 8]]
NEW_TOKENS = 16
VOCAB = tuple(range(0, 64, 3))    # 22 of the 64 ids


def random_mtp(cfg, target_cfg=TINY, seed=1, scale=10.0):
  mtp = MTP(cfg, target_cfg, rngs=nnx.Rngs(seed))
  for depth in mtp.depths:
    depth.layer.mlp.down_proj.kernel[...] *= scale
  return mtp


def _drafts(tiny_split, mtp, sample: bool):
  """(tokens, logits, q) of one draft after prefilling PROMPTS (T = 1 when sampling)."""
  drafter, params = MTPDrafter.from_model(mtp, sample_proposals=sample)
  engine = SpeculativeEngine(tiny_split[0], drafter=drafter,
                             sampling=SamplingSpec(greedy=not sample))
  lens = np.array([len(p) for p in PROMPTS], np.int32)
  prompts = np.zeros((len(PROMPTS), lens.max()), np.int32)
  for r, p in enumerate(PROMPTS):
    prompts[r, :len(p)] = p
  state = engine.prefill(tiny_split[1], params, prompts, lens, temperature=1.0,
                         max_new_tokens=NEW_TOKENS)
  draft = jax.jit(lambda p, st, t: drafter.draft(p, st.drafter_state, nnx.merge(
      tiny_split[0], t), engine.context(st), jax.random.key(0)))
  return draft(params, state, tiny_split[1])


@pytest.mark.slow
def test_reduced_drafts_restrict_the_full_head(tiny_split):
  full = random_mtp(MTPConfig(num_depths=3))
  reduced = random_mtp(MTPConfig(num_depths=3, draft_vocab=VOCAB))
  assert reduced.draft_vocab_size == len(VOCAB)
  ids = np.asarray(VOCAB)
  _, full_logits, _ = _drafts(tiny_split, full, sample=False)
  tokens, logits, q = _drafts(tiny_split, reduced, sample=False)
  assert q is None and logits.shape == (2, 3, len(VOCAB))
  # Depth 1 sees the same inputs (deeper depths read the earlier, now different, drafts).
  np.testing.assert_allclose(np.asarray(logits)[:, 0], np.asarray(full_logits)[:, 0, ids],
                             atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(tokens), ids[np.argmax(np.asarray(logits), -1)])
  target = nnx.merge(*tiny_split)
  seq = np.random.default_rng(0).integers(0, 64, (2, 12)).astype(np.int32)
  h0 = target(seq).hidden_BTD
  for k, (h_full, h_red) in enumerate(zip(full(target, h0, seq), reduced(target, h0, seq)),
                                      start=1):
    np.testing.assert_allclose(np.asarray(reduced.logits(target, k, h_red)),
                               np.asarray(full.logits(target, k, h_full))[..., ids],
                               atol=1e-5, rtol=1e-5)

  tokens, logits, q = _drafts(tiny_split, reduced, sample=True)
  q = np.asarray(q)
  assert q.shape == (2, 3, TINY.vocab_size)
  outside = np.setdiff1d(np.arange(TINY.vocab_size), ids)
  assert np.all(q[..., outside] == 0.0)
  np.testing.assert_allclose(q[..., ids], np.asarray(jax.nn.softmax(logits, -1)), atol=1e-6)
  np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)
  tokens = np.asarray(tokens)
  assert np.isin(tokens, ids).all()
  assert np.all(np.take_along_axis(q, tokens[..., None], -1) > 0)


@pytest.mark.slow
def test_greedy_reduced_mtp_equals_ar(tiny_split):
  engine = SpeculativeEngine(tiny_split[0])
  ar, _ = generate(engine, tiny_split[1], None, PROMPTS, NEW_TOKENS)
  drafter, params = MTPDrafter.from_model(random_mtp(MTPConfig(num_depths=3,
                                                               draft_vocab=VOCAB)))
  outs, state = generate(SpeculativeEngine(tiny_split[0], drafter=drafter), tiny_split[1],
                         params, PROMPTS, NEW_TOKENS)
  assert outs == ar
  assert int(np.asarray(state.stats.proposed_B).sum()) > 0


@pytest.mark.slow
def test_sampled_reduced_mtp_is_lossless(small_vocab_model):
  """T = 1, sampled drafts whose q misses 5 of the 12 tokens the target can emit."""
  graphdef, params = nnx.split(small_vocab_model)
  mtp = random_mtp(MTPConfig(num_depths=2, draft_vocab=(0, 2, 3, 5, 7, 8, 11)),
                   small_vocab_model.cfg, seed=30, scale=30.0)
  drafter, dparams = MTPDrafter.from_model(mtp, sample_proposals=True)
  engine = SpeculativeEngine(graphdef, drafter=drafter, sampling=SamplingSpec(greedy=False))
  check_engine_samples_match_target(engine, small_vocab_model, params, dparams,
                                    [1, 5, 2, 7], temperature=1.0, num_samples=40_000,
                                    num_tokens=3)


def _token_map_config(mtp, tmp_path) -> tuple:
  """(decode config of the tiny target with `mtp` saved and VOCAB reversed as its token
  map, the map's path)."""
  save_mtp(str(tmp_path / 'mtp'), mtp)
  token_map = tmp_path / 'map.json'
  token_map.write_text(json.dumps(list(reversed(VOCAB))))
  cfg = common.decode_config('tiny')
  cfg.drafter = 'mtp'
  cfg.drafters.mtp.path = str(tmp_path / 'mtp')
  cfg.drafters.mtp.token_map = str(token_map)
  return cfg, token_map


def test_a_token_map_sets_the_draft_vocabulary_and_bad_maps_are_refused(tiny_model, tmp_path):
  """The quick check's part of the test below (no decoding): the drafter a token map gives
  drafts from the map's ids, in order; a bad map is one error naming the problem."""
  cfg, token_map = _token_map_config(random_mtp(MTPConfig(num_depths=3)), tmp_path)
  drafter, _ = registry.build_drafter(cfg, tiny_model)
  assert drafter.config.draft_vocab == VOCAB
  for text, message in (('[1, 2, 2]', 'repeats token ids'), ('[0, 64]', r'in \[0, 64\)'),
                        ('[]', 'non-empty JSON list'), ('[1,', 'not JSON')):
    token_map.write_text(text)
    with pytest.raises(ValueError, match=message):
      registry.build_drafter(cfg, tiny_model)


@pytest.mark.slow
def test_token_map_restricts_a_full_vocabulary_mtp(tiny_model, tiny_split, tmp_path):
  """drafters.mtp.token_map gives the drafter a trained reduced MTP would have (same
  weights, drafts inside the map); greedy output equals AR; bad maps are refused."""
  full = random_mtp(MTPConfig(num_depths=3))
  cfg, token_map = _token_map_config(full, tmp_path)
  drafter, params = registry.build_drafter(cfg, tiny_model)
  assert drafter.config.draft_vocab == VOCAB
  expected, _ = MTPDrafter.from_model(random_mtp(MTPConfig(num_depths=3, draft_vocab=VOCAB)))
  assert drafter.config == expected.config

  ar, _ = generate(SpeculativeEngine(tiny_split[0]), tiny_split[1], None, PROMPTS, NEW_TOKENS)
  engine = SpeculativeEngine(tiny_split[0], drafter=drafter)
  outs, state = generate(engine, tiny_split[1], params, PROMPTS, NEW_TOKENS)
  assert outs == ar
  assert int(np.asarray(state.stats.proposed_B).sum()) > 0

  for text, message in (('[1, 2, 2]', 'repeats token ids'), ('[0, 64]', r'in \[0, 64\)'),
                        ('{"a": 1}', 'non-empty JSON list'), ('[1.5]', 'non-empty JSON list'),
                        ('[]', 'non-empty JSON list'), ('[1,', 'not JSON')):
    token_map.write_text(text)
    with pytest.raises(ValueError, match=message):
      registry.build_drafter(cfg, tiny_model)
  save_mtp(str(tmp_path / 'reduced'), random_mtp(MTPConfig(num_depths=3, draft_vocab=VOCAB)))
  cfg.drafters.mtp.path = str(tmp_path / 'reduced')
  with pytest.raises(ValueError, match='already drafts from 22 tokens'):
    registry.build_drafter(cfg, tiny_model)


# ------------------------------------------------------------------------- training


@pytest.mark.slow
def test_posthoc_training_with_reduced_vocab(tiny_model, tiny_split, tmp_path):
  """The subset is the most target-written tokens of the training rows; training lowers
  every depth's loss; the export keeps the subset and decodes greedy == AR, accepting."""
  tokens, loss_mask = greedy_rows(tiny_model)
  data = {'tokens': tokens, 'loss_mask': loss_mask}
  tcfg = ml_collections.ConfigDict(dict(
      num_steps=80, batch_size=8, seq_len=29, learning_rate=1e-2, warmup_ratio=0.05,
      weight_decay=0.0, grad_clip=1.0, b1=0.9, b2=0.95, seed=0, log_every=80,
      eval_every=80, eval_windows=16, ckpt_every=1000, max_minutes=0.0,
      storage_dtype='float32', mtp_beta=0.6))
  task = posthoc_task(tiny_model, MTPConfig(num_depths=2), data, tcfg, heldout_fraction=0.25,
                      draft_vocab_size=16)
  train_rows = 48 - 12
  expected = frequent_tokens(data['tokens'][:train_rows], data['loss_mask'][:train_rows], 16,
                             TINY.vocab_size)
  assert task.model.cfg.draft_vocab == expected
  before = task.evaluate(task.model, task.frozen)
  after = trainer.train(task, tcfg, str(tmp_path))['eval']
  for k in (1, 2):
    assert after[f'loss_d{k}'] < before[f'loss_d{k}'] - 0.5, (before, after)
  assert after['agree_d1'] > before['agree_d1']

  mtp = load_mtp(str(tmp_path / 'final'))
  assert mtp.cfg.draft_vocab == expected
  ar, _ = generate(SpeculativeEngine(tiny_split[0]), tiny_split[1], None, PROMPTS,
                   NEW_TOKENS)
  drafter, params = MTPDrafter.from_model(mtp)
  outs, state = generate(SpeculativeEngine(tiny_split[0], drafter=drafter), tiny_split[1],
                         params, PROMPTS, NEW_TOKENS)
  assert outs == ar
  assert int(np.asarray(state.stats.accepted_B).sum()) > 0

  with pytest.raises(ValueError, match=r'mtp.draft_vocab_size must be in \[1, 64\]'):
    posthoc_task(tiny_model, MTPConfig(), data, tcfg, 0.25, draft_vocab_size=65)
  cfg = ml_collections.ConfigDict({'training': tcfg, 'mtp': {'draft_vocab_size': 8}})
  with pytest.raises(ValueError, match='needs training.task=mtp_posthoc'):
    build_joint_task(cfg, str(tmp_path))
