"""DSpark heads and formats: draft and confidence logits equal speculators' model
definitions (`speculators/models/dspark/model_definitions.py`, loaded from its file so the
package's heavy imports are skipped) on the same random weights, read from a directory in
speculators' saved layout; without torch/speculators the reference is a hand-written
numpy version of the same formulas over that layout. Also: the sequential walk equals
teacher forcing on its own tokens, speculators-form round trip with the calibration,
and bad input (markov_rank 0 with the confidence head, a missing head) as one error."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from conftest import REPO_ROOT, TINY
from dspec import checkpoint
from dspec.models import dspark
from dspec.models.formats.dspark import load_dspark, save_speculators
from dspec.models.transformer import Transformer

BLOCK = 4
RANK = 6


def _speculators_definitions():
  """speculators' dspark model_definitions module, or None when it cannot be loaded."""
  try:
    spec = importlib.util.find_spec('speculators')
    import torch  # noqa: F401
  except ImportError:
    return None
  if spec is None or spec.origin is None:
    return None
  path = os.path.join(os.path.dirname(spec.origin), 'models', 'dspark', 'model_definitions.py')
  if not os.path.exists(path):
    return None
  module_spec = importlib.util.spec_from_file_location('_speculators_dspark_defs', path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module


def _reference_heads_torch(defs, head_type, with_markov, seed):
  """speculators' heads with seeded random weights: (tensors in the saved layout, fn)."""
  import torch
  torch.manual_seed(seed)
  markov = defs.MarkovHead(verifier_vocab_size=TINY.vocab_size,
                           draft_vocab_size=TINY.vocab_size, markov_rank=RANK,
                           hidden_size=TINY.embed_dim, head_type=head_type)
  conf = defs.ConfidenceHead(TINY.embed_dim + (RANK if with_markov else 0))
  with torch.no_grad():
    for p in list(markov.parameters()) + list(conf.parameters()):
      p.normal_(0.0, 0.5)
  tensors = {f'markov_head.{k}': v.numpy() for k, v in markov.state_dict().items()}
  tensors.update({f'confidence_head.{k}': v.numpy() for k, v in conf.state_dict().items()})

  def run(base_NKV, hidden_NKD, prev_NK):
    with torch.no_grad():
      h = torch.from_numpy(hidden_NKD)
      prev = torch.from_numpy(prev_NK).long()
      emb = markov.prev_embeddings(prev)
      logits = torch.from_numpy(base_NKV) + markov.block_bias(
          prev_token_ids=prev, hidden_states=h, prev_emb=emb)
      feats = torch.cat([h, emb], -1) if with_markov else h
      return logits.numpy(), conf(feats).numpy()

  return tensors, run


def _reference_heads_numpy(tensors, head_type, with_markov):
  """The same formulas written out over the saved layout (torch Linear: x @ W.T + b)."""
  w1 = tensors['markov_head.markov_w1.weight']
  w2 = tensors['markov_head.markov_w2.weight']
  sig = lambda x: 1.0 / (1.0 + np.exp(-x))
  lin = lambda name, x: x @ tensors[name + '.weight'].T + tensors.get(name + '.bias', 0.0)

  def run(base_NKV, hidden_NKD, prev_NK):
    emb = w1[prev_NK]
    if head_type == 'vanilla':
      latent = emb
    elif head_type == 'gated':
      latent = sig(lin('markov_head.gate_proj', np.concatenate([hidden_NKD, emb], -1))) * emb
    else:
      state, outs = np.zeros(emb.shape[:1] + emb.shape[2:]), []
      for k in range(emb.shape[1]):
        z = lin('markov_head.joint_proj',
                np.concatenate([state, emb[:, k], hidden_NKD[:, k]], -1))
        gate, cand, out = np.split(z, 3, axis=-1)
        state = sig(gate) * state + (1 - sig(gate)) * np.tanh(cand)
        outs.append(np.tanh(out))
      latent = np.stack(outs, axis=1)
    feats = np.concatenate([hidden_NKD, emb], -1) if with_markov else hidden_NKD
    return base_NKV + latent @ w2.T, lin('confidence_head.proj', feats)[..., 0]

  return run


def _speculators_dir(tmp_path, head_type, with_markov, head_tensors):
  """A speculators DSpark directory: a random dspec body written by `save_speculators`,
  its head tensors replaced by `head_tensors`."""
  cfg = dspark.DSparkConfig.create(TINY.num_layers, num_layers=1, block_size=BLOCK,
                                   mask_token_id=63, target_layer_ids=(0,), markov_rank=RANK,
                                   markov_head_type=head_type,
                                   confidence_head_with_markov=with_markov,
                                   layer_types=('full_attention',))
  model = dspark.DSparkModel(cfg, TINY, rngs=nnx.Rngs(1))
  path = str(tmp_path / f'spec_{head_type}_{with_markov}')
  save_speculators(path, model)
  tensors = load_file(os.path.join(path, 'model.safetensors'))
  tensors = {k: v for k, v in tensors.items() if not k.startswith(('markov_head.',
                                                                    'confidence_head.'))}
  tensors.update({k: np.ascontiguousarray(v, np.float32) for k, v in head_tensors.items()})
  save_file(tensors, os.path.join(path, 'model.safetensors'))
  return path


@pytest.fixture(scope='module')
def target():
  return Transformer(TINY, rngs=nnx.Rngs(0))


@pytest.mark.slow
@pytest.mark.parametrize('head_type,with_markov', [('vanilla', True), ('gated', True),
                                                   ('rnn', True), ('rnn', False)])
def test_heads_match_speculators(tmp_path, target, head_type, with_markov):
  defs = _speculators_definitions()
  rng = np.random.default_rng(0)
  hidden = rng.normal(size=(3, BLOCK, TINY.embed_dim)).astype(np.float32)
  prev = rng.integers(0, TINY.vocab_size, (3, BLOCK))
  base = np.array(target.logits(jnp.asarray(hidden)), np.float32)
  if defs is not None:
    tensors, reference = _reference_heads_torch(defs, head_type, with_markov, seed=5)
    handwritten = _reference_heads_numpy(tensors, head_type, with_markov)(base, hidden, prev)
  else:   # hand-written fixture in speculators' saved layout
    keys = iter(jax.random.split(jax.random.key(5), 8))
    shapes = {'markov_head.markov_w1.weight': (TINY.vocab_size, RANK),
              'markov_head.markov_w2.weight': (TINY.vocab_size, RANK),
              'confidence_head.proj.weight': (1, TINY.embed_dim + RANK * with_markov),
              'confidence_head.proj.bias': (1,)}
    if head_type == 'gated':
      shapes.update({'markov_head.gate_proj.weight': (RANK, TINY.embed_dim + RANK),
                     'markov_head.gate_proj.bias': (RANK,)})
    if head_type == 'rnn':
      shapes.update({'markov_head.joint_proj.weight': (3 * RANK, 2 * RANK + TINY.embed_dim),
                     'markov_head.joint_proj.bias': (3 * RANK,)})
    tensors = {k: 0.5 * np.asarray(jax.random.normal(next(keys), s)) for k, s in
               shapes.items()}
    reference = _reference_heads_numpy(tensors, head_type, with_markov)
    handwritten = None
  want_logits, want_conf = reference(base, hidden, prev)
  if handwritten is not None:
    np.testing.assert_allclose(handwritten[0], want_logits, atol=1e-4)
    np.testing.assert_allclose(handwritten[1], want_conf, atol=1e-4)

  model = load_dspark(_speculators_dir(tmp_path, head_type, with_markov, tensors),
                              num_target_layers=TINY.num_layers)
  logits, conf = model.heads(target, jnp.asarray(hidden).reshape(1, -1, TINY.embed_dim),
                             jnp.asarray(prev).reshape(1, -1))
  np.testing.assert_allclose(np.asarray(logits).reshape(want_logits.shape), want_logits,
                             atol=1e-4)
  np.testing.assert_allclose(np.asarray(conf).reshape(want_conf.shape), want_conf,
                             atol=1e-4)

  # The sequential walk is teacher forcing on its own drafts.
  walk = model.walk(target, jnp.asarray(hidden), jnp.asarray(prev[:, 0]))
  prev_walk = jnp.concatenate([jnp.asarray(prev[:, :1]), walk.tokens_BG[:, :-1]], axis=1)
  tf_logits, tf_conf = model.heads(target, jnp.asarray(hidden).reshape(1, -1, TINY.embed_dim),
                                   prev_walk.reshape(1, -1))
  np.testing.assert_array_equal(np.asarray(walk.tokens_BG),
                                np.asarray(jnp.argmax(tf_logits, -1)).reshape(3, BLOCK))
  np.testing.assert_allclose(np.asarray(walk.conf_logits_BG),
                             np.asarray(tf_conf).reshape(3, BLOCK), atol=1e-5)


@pytest.mark.slow
def test_speculators_round_trip_keeps_weights_and_calibration(tmp_path):
  cfg = dspark.DSparkConfig.create(TINY.num_layers, num_layers=1, block_size=BLOCK,
                                   mask_token_id=63, target_layer_ids=(0,), markov_rank=RANK,
                                   markov_head_type='gated',
                                   confidence_temperatures=(1.5, 2.0, 0.5, 1.0))
  model = dspark.DSparkModel(cfg, TINY, rngs=nnx.Rngs(2))
  save_speculators(tmp_path / 'a', model)
  back = load_dspark(tmp_path / 'a', num_target_layers=TINY.num_layers)
  assert back.cfg.confidence_temperatures == cfg.confidence_temperatures
  assert back.cfg.markov_head_type == 'gated' and back.cfg.block_size == BLOCK
  mine = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  theirs = nnx.to_pure_dict(nnx.state(back, nnx.Param))
  jax.tree.map(np.testing.assert_array_equal, mine, theirs)
  # dspec checkpoint form too
  checkpoint.save_model(tmp_path / 'b', model, kind='dspark',
                        config={'dspark': cfg.to_dict(), 'target': TINY.to_dict()})
  assert load_dspark(tmp_path / 'b').cfg == cfg


def test_bad_input_is_one_clear_error(tmp_path):
  with pytest.raises(ValueError, match='markov_rank is 0 but the confidence head'):
    dspark.DSparkConfig.create(TINY.num_layers, num_layers=1, block_size=BLOCK,
                               mask_token_id=63, target_layer_ids=(0,), markov_rank=0)
  with pytest.raises(ValueError, match='markov_head_type'):
    dspark.DSparkConfig.create(TINY.num_layers, num_layers=1, block_size=BLOCK,
                               mask_token_id=63, target_layer_ids=(0,), markov_head_type='lstm')
  cfg = dspark.DSparkConfig.create(TINY.num_layers, num_layers=1, block_size=BLOCK,
                                   mask_token_id=63, target_layer_ids=(0,), markov_rank=RANK)
  model = dspark.DSparkModel(cfg, TINY, rngs=nnx.Rngs(3))
  save_speculators(tmp_path / 's', model)
  tensors = load_file(str(tmp_path / 's' / 'model.safetensors'))
  for head, key in [('confidence_head', 'enable_confidence_head'),
                    ('markov_head', 'markov_rank')]:
    kept = {k: v for k, v in tensors.items() if not k.startswith(head)}
    save_file(kept, str(tmp_path / 's' / 'model.safetensors'))
    with pytest.raises(ValueError, match=f'{head} tensors are missing but config.json {key}'):
      load_dspark(tmp_path / 's', num_target_layers=TINY.num_layers)
  # A dspec checkpoint whose config asks for a head it does not hold.
  off = dspark.DSparkConfig.create(TINY.num_layers, num_layers=1, block_size=BLOCK,
                                   mask_token_id=63, target_layer_ids=(0,), markov_rank=RANK,
                                   enable_confidence_head=False)
  lying = dict(off.to_dict(), enable_confidence_head=True)
  checkpoint.save_model(tmp_path / 'd', dspark.DSparkModel(off, TINY, rngs=nnx.Rngs(4)),
                        kind='dspark', config={'dspark': lying, 'target': TINY.to_dict()})
  with pytest.raises(ValueError, match='confidence_head weights are missing'):
    load_dspark(tmp_path / 'd')


@pytest.mark.multiprocess
def test_markov_rank_zero_with_the_confidence_head_is_one_line_from_train(tmp_path):
  """The CLI path: `scripts/train.py` with markov_rank=0 and the confidence head on."""
  data = tmp_path / 'data'
  data.mkdir()
  seq = np.tile(np.arange(5, 37, dtype=np.int32), (2, 1))
  np.savez(data / 'shard_00000.npz', tokens=seq, loss_mask=np.ones_like(seq, bool),
           lengths=np.full(2, seq.shape[1], np.int32))
  (data / 'manifest.json').write_text(json.dumps({'shards': ['shard_00000.npz'],
                                                  'complete': True}))
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO_ROOT, 'scripts', 'train.py'),
       '--config=configs/dspark_demo.py:tiny', '--config.dspark.markov_rank=0',
       f'--config.data.path={data}', f'--workdir={tmp_path / "run"}'],
      cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error:')]
  assert proc.returncode == 1 and 'Traceback' not in proc.stderr, proc.stderr
  assert errors == ['error: dspark markov_rank is 0 but the confidence head reads the Markov '
                    'embedding (confidence_head_with_markov): set markov_rank > 0 or '
                    'confidence_head_with_markov=False'], proc.stderr
