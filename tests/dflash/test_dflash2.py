"""DFlash-2 model: conv tail (identity init, causal in the block, zero across blocks),
train/draft layout agreement, the candidate selector's walk and its q (sampled walks
follow q; rejection sampling with q is lossless even when the candidates miss the target's
mode), the selector loss, and the dflash2 training task through export."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import REPO_ROOT, TINY
from lossless_checks import chi_square_pvalue
from configs import dflash2_demo
from dspec.decoding.verification import rejection_verify
from dspec.models import dflash as dflash_lib
from dspec.models import dflash2
from dspec.models.formats.dflash import load_dflash
from dspec.models.transformer import Transformer
from dspec.training import dflash_task, tasks

WIDE = TINY.__class__(**{**TINY.to_dict(), 'embed_dim': 64, 'num_layers': 3})
SELECTOR = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
BLOCK = 6


def _config(**fields):
  return dflash2.DFlash2Config.create(num_target_layers=WIDE.num_layers, num_layers=2,
                                      block_size=BLOCK, mask_token_id=WIDE.vocab_size - 1,
                                      **{**SELECTOR, **fields})


def _randomize_convs(drafter, seed):
  keys = iter(jax.random.split(jax.random.key(seed), 64))
  for conv in list(drafter.attention_convs) + list(drafter.mlp_convs):
    conv.base_kernel[...] = jax.random.normal(next(keys), conv.base_kernel.shape)
    kernel = conv.kernel_projection.kernel
    kernel[...] = 0.3 * jax.random.normal(next(keys), kernel.shape)


def _target():
  model = Transformer(WIDE, rngs=nnx.Rngs(0))
  model.lm_head[...] = model.lm_head[...] * 20.0
  return model


def _draft(drafter, target, tokens_1S, anchor):
  """Drafting forward of the block anchored at `anchor` (context = positions < anchor)."""
  s = tokens_1S.shape[1]
  out = target(tokens_1S, taps=drafter.cfg.target_layer_ids, compute_logits=False)
  ctx_k, ctx_v = drafter.context_kv(drafter.fuse(out.taps_BTND, target), jnp.arange(s)[None])
  block = jnp.full((1, BLOCK), drafter.cfg.mask_token_id, jnp.int32)
  block = block.at[0, 0].set(tokens_1S[0, anchor])
  return drafter(target.embed(block), anchor + jnp.arange(BLOCK)[None], ctx_k, ctx_v,
                 drafter.cfg.draft_masks(BLOCK), jnp.array([anchor]))


@pytest.mark.slow
def test_convs_start_as_identity():
  """From scratch, DFlash-2's backbone computes exactly DFlash on the same weights."""
  target = _target()
  cfg = _config()
  two = dflash2.DFlash2Model(cfg, WIDE, rngs=nnx.Rngs(1))
  base_fields = {k: v for k, v in cfg.to_dict().items() if k not in SELECTOR}
  one = dflash_lib.DFlashModel(dflash_lib.DFlashConfig.from_dict(base_fields), WIDE,
                                 rngs=nnx.Rngs(2))
  shared = nnx.to_pure_dict(nnx.state(one, nnx.Param))
  state = nnx.state(two, nnx.Param)
  pure = nnx.to_pure_dict(state)
  pure.update(shared)
  nnx.replace_by_pure_dict(state, pure)
  nnx.update(two, state)
  tokens = jax.random.randint(jax.random.key(0), (1, 12), 0, WIDE.vocab_size - 1)
  np.testing.assert_array_equal(np.asarray(_draft(two, target, tokens, 7)),
                                np.asarray(_draft(one, target, tokens, 7)))


@pytest.mark.slow
def test_conv_formula_causal_in_block_zero_across_blocks():
  key_x, key_d, key_b = jax.random.split(jax.random.key(3), 3)
  block, groups, group, taps = 4, 2, 3, 3
  x = jax.random.normal(key_x, (1, 2 * block, groups * group))
  delta = jax.random.normal(key_d, (1, 2 * block, taps, groups))
  base = jax.random.normal(key_b, (taps, groups * group))
  slot = jnp.arange(2 * block) % block
  y = np.asarray(dflash2.grouped_causal_conv(x, delta, base, slot))
  xn, dn, bn = np.asarray(x), np.asarray(delta), np.asarray(base)
  want = np.zeros_like(y)
  for i in range(2 * block):
    for t in range(min(taps, i % block + 1)):
      coef = bn[t] + np.repeat(dn[0, i, t], group)
      want[0, i] += coef * xn[0, i - t]
  np.testing.assert_allclose(y, want, atol=1e-5)
  # a change at slot 1 of block 1 reaches slots 1.. of block 1 only
  y2 = np.asarray(dflash2.grouped_causal_conv(x.at[0, block + 1].add(1.0), delta, base, slot))
  changed = np.abs(y2 - y).max(axis=-1)[0] > 0
  assert changed.tolist() == [False] * (block + 1) + [True] * (block - 1)


@pytest.mark.slow
def test_training_layout_matches_drafting():
  """The per-layer training masks (z-lab causal/sliding semantics) and the conv's block
  boundaries give each block of the training layout exactly its drafting output."""
  target = _target()
  cfg = _config(layer_types=('sliding_attention', 'full_attention'), sliding_window=3,
                input_embedding_scale=1.3)
  drafter = dflash2.DFlash2Model(cfg, WIDE, rngs=nnx.Rngs(4))
  _randomize_convs(drafter, 5)
  s = 16
  tokens = jax.random.randint(jax.random.key(1), (1, s), 0, WIDE.vocab_size - 1)
  anchors = jnp.array([[3, 9]])
  out = target(tokens, taps=cfg.target_layer_ids, compute_logits=False)
  ctx_k, ctx_v = drafter.context_kv(drafter.fuse(out.taps_BTND, target), jnp.arange(s)[None])
  pos = anchors[..., None] + jnp.arange(BLOCK)
  block = jnp.where(jnp.arange(BLOCK) == 0, tokens[0, anchors[0]][:, None],
                    cfg.mask_token_id).reshape(1, -1)
  hidden = drafter(target.embed(block), pos.reshape(1, -1), ctx_k, ctx_v,
                   cfg.train_masks(s), anchors, block_size=BLOCK)
  for n, anchor in enumerate(anchors[0].tolist()):
    np.testing.assert_allclose(np.asarray(hidden[:, n * BLOCK:(n + 1) * BLOCK]),
                               np.asarray(_draft(drafter, target, tokens, anchor)),
                               atol=1e-5)


def _selector(vocab, dim, rank, seed):
  """A selector whose pair scores are O(1) (unit-variance codebooks and projection)."""
  cfg = TINY.__class__(**{**TINY.to_dict(), 'vocab_size': vocab, 'embed_dim': dim})
  sel = dflash2.CandidateSelector(dim, vocab, rank, cfg, rngs=nnx.Rngs(seed))
  keys = jax.random.split(jax.random.key(seed), 3)
  for key, param in zip(keys, (sel.predecessor_codebook, sel.successor_codebook,
                               sel.hidden_projection.kernel)):
    param[...] = jax.random.normal(key, param.shape) / param.shape[-1] ** 0.25
  return sel


@pytest.mark.slow
def test_sampled_walk_follows_q():
  """Sampled walks: the first token and the (first, second) pair are distributed as the
  q the walk returns (chi-square), and the greedy walk takes the argmax path."""
  vocab, dim, k, n = 10, 16, 4, 20000
  sel = _selector(vocab, dim, 8, 6)
  logits = jax.random.normal(jax.random.key(7), (1, 2, vocab))
  hidden = jax.random.normal(jax.random.key(8), (1, 2, dim))
  anchor = jnp.array([3])
  greedy = dflash2.select_walk(sel, k, logits, hidden, anchor, greedy=True)
  walk = jax.jit(lambda key: dflash2.select_walk(
      sel, k, jnp.tile(logits, (n, 1, 1)), jnp.tile(hidden, (n, 1, 1)), jnp.tile(anchor, n),
      greedy=False, temperature=0.7, key=key))(jax.random.key(9))
  tokens, q = np.asarray(walk.tokens_BG), np.asarray(walk.q_over_vocab(vocab))
  q1 = q[0, 0]
  assert chi_square_pvalue(np.bincount(tokens[:, 0], minlength=vocab), q1) > 1e-3
  joint = np.zeros((vocab, vocab))
  for a in np.unique(tokens[:, 0]):
    joint[a] = q1[a] * q[np.flatnonzero(tokens[:, 0] == a)[0], 1]
  counts = np.bincount(tokens[:, 0] * vocab + tokens[:, 1], minlength=vocab * vocab)
  assert chi_square_pvalue(counts, joint) > 1e-3
  # the q of slot 2 depends on the sampled predecessor (the pair scores matter)
  firsts = np.unique(tokens[:, 0])
  rows = [q[np.flatnonzero(tokens[:, 0] == a)[0], 1] for a in firsts]
  assert max(np.abs(r - rows[0]).max() for r in rows) > 0.05
  top = int(np.argmax(q1))
  assert int(greedy.tokens_BG[0, 0]) == top


@pytest.mark.slow
def test_rejection_with_selector_q_is_lossless_when_candidates_miss_the_mode():
  """Rejection sampling of the walk's first draft with its q (scattered over the
  vocabulary) emits exactly the target's distribution, whose mode the K candidates miss."""
  vocab, dim, k, n = 8, 16, 3, 40000
  sel = _selector(vocab, dim, 4, 10)
  logits = jnp.array([[[4.0, 3.0, 2.5, -5.0, -5.0, -5.0, 0.0, 1.0]] * 2])
  p1 = np.array([0.02, 0.1, 0.05, 0.4, 0.2, 0.03, 0.15, 0.05])   # mode 3: not a candidate
  hidden = jax.random.normal(jax.random.key(11), (1, 2, dim))

  @jax.jit
  def emit(key):
    key_walk, key_verify = jax.random.split(key)
    walk = dflash2.select_walk(sel, k, jnp.tile(logits, (n, 1, 1)),
                               jnp.tile(hidden, (n, 1, 1)), jnp.zeros((n,), jnp.int32),
                               greedy=False, temperature=1.0, key=key_walk)
    p = jnp.tile(jnp.asarray(p1, jnp.float32), (n, 3, 1))
    accepted, out = rejection_verify(key_verify, walk.tokens_BG, jnp.full((n,), 2),
                                     walk.q_over_vocab(vocab), p)
    return accepted, out[:, 0], walk.cand_BGK

  accepted, first, cand = map(np.asarray, emit(jax.random.key(12)))
  assert 3 not in cand[0, 0] and 0 < (accepted > 0).mean() < 1
  assert chi_square_pvalue(np.bincount(first, minlength=vocab), p1) > 1e-3


@pytest.mark.slow
def test_selector_terms_inject_missing_gold():
  drafter = dflash2.DFlash2Model(_config(), WIDE, rngs=nnx.Rngs(13))
  k = drafter.cfg.selector_top_k
  logits = jax.random.normal(jax.random.key(14), (1, 1, 3, WIDE.vocab_size))
  order = np.argsort(-np.asarray(logits[0, 0]), axis=-1)
  labels = jnp.asarray([[[order[0, 1], order[1, k + 5], order[2, 0]]]], jnp.int32)
  hidden = jax.random.normal(jax.random.key(15), (1, 1, 3, WIDE.embed_dim))
  prev = jnp.zeros((1, 1, 3), jnp.int32)
  terms = dflash_task.selector_terms(drafter, hidden, logits, labels, prev)
  assert np.asarray(terms['recall'])[0, 0].tolist() == [True, False, True]
  assert not bool(terms['sel_hit'][0, 0, 1])
  # the missing gold is scored as the K-th candidate: CE over the injected set
  cand = order[1, :k].copy()
  cand[k - 1] = int(labels[0, 0, 1])
  unary = np.asarray(logits[0, 0, 1])[cand]
  scores = np.asarray(drafter.candidate_selector.scores(
      jnp.asarray(unary)[None, None], hidden[0, :, 1:2], prev[0, :, 1:2],
      jnp.asarray(cand)[None, None]))[0, 0]
  want = np.log(np.exp(scores).sum()) - scores[k - 1]
  np.testing.assert_allclose(float(terms['sel_ce'][0, 0, 1]), want, rtol=1e-5)


def test_selector_keeps_the_fast_top_k():
  """The selector's training terms and its walk compile top-k without a vocabulary sort
  (a sort made the demo DFlash-2 training step 4.1 s against 2.0 s)."""
  drafter = dflash2.DFlash2Model(_config(), WIDE, rngs=nnx.Rngs(13))
  logits = jnp.zeros((1, 2, 3, WIDE.vocab_size))
  hidden = jnp.zeros((1, 2, 3, WIDE.embed_dim))
  tokens = jnp.zeros((1, 2, 3), jnp.int32)
  terms = jax.jit(lambda l, h: dflash_task.selector_terms(drafter, h, l, tokens, tokens))
  walk = jax.jit(lambda l, h: dflash2.select_walk(drafter.candidate_selector, 4, l, h,
                                                  tokens[:, 0, 0], greedy=True).tokens_BG)
  for fn, args in ((terms, (logits, hidden)), (walk, (logits[0], hidden[0]))):
    assert ' sort(' not in fn.lower(*args).compile().as_text()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_dflash2_task_trains_loads_and_exports(tmp_path):
  data = tmp_path / 'data'
  data.mkdir()
  seq = np.tile(np.array([[5, 6, 7, 8, 9, 10, 11, 12] * 5], np.int32), (4, 1))
  np.savez(data / 'shard_00000.npz', tokens=seq,
           loss_mask=np.arange(seq.shape[1])[None].repeat(4, 0) >= 6,
           lengths=np.full(4, seq.shape[1], np.int32))
  (data / 'manifest.json').write_text(json.dumps({'shards': ['shard_00000.npz'],
                                                  'complete': True}))
  cfg = dflash2_demo.get_config('tiny')
  cfg.dflash.target_layer_ids = (0,)   # z-lab reads a last-layer tap after the final norm
  cfg.data.path, cfg.data.heldout_fraction = str(data), 0.0
  cfg.training.update(num_steps=8, seq_len=seq.shape[1], log_every=8, eval_every=8,
                      ckpt_every=8, learning_rate=1e-2)
  result = tasks.run_training(cfg, str(tmp_path / 'run'))
  for key in ('sel_loss', 'sel_tau_est', 'recall', 'unary_loss'):
    assert np.isfinite(result['last'][key])
  drafter = load_dflash(str(tmp_path / 'run' / 'final'))
  assert isinstance(drafter, dflash2.DFlash2Model)
  out = tmp_path / 'zlab'
  proc = subprocess.run([sys.executable, os.path.join(REPO_ROOT, 'scripts', 'export_drafter.py'),
                         f'--path={tmp_path / "run" / "final"}', f'--out={out}'],
                        capture_output=True, text=True, cwd=REPO_ROOT)
  assert proc.returncode == 0, proc.stderr
  again = load_dflash(str(out))
  assert again.cfg.selector_top_k == drafter.cfg.selector_top_k
  for a, b in zip(jax.tree.leaves(nnx.state(again, nnx.Param)),
                  jax.tree.leaves(nnx.state(drafter, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  (out / 'notes.txt').write_text('mine')   # an earlier export is replaced, a user's file not
  proc = subprocess.run([sys.executable, os.path.join(REPO_ROOT, 'scripts', 'export_drafter.py'),
                         f'--path={tmp_path / "run" / "final"}', f'--out={out}'],
                        capture_output=True, text=True, cwd=REPO_ROOT)
  assert proc.returncode == 1 and proc.stderr.strip().count('\n') == 0
  assert 'files dspec did not write' in proc.stderr
