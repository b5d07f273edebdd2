"""Parity with z-lab's `dflash` package (model level) and the z-lab / speculators formats.

A random HF Qwen3 target (6 layers, 128-token vocabulary) is saved with `save_pretrained`
and imported with `dspec.hf_import`; random z-lab drafters are built with the `dflash`
package, saved with `save_pretrained` and loaded by dspec's format reader. On the same
context the draft logits (and DFlash-2's selector walk) must match z-lab's within 1e-4,
for a full block and for the end-of-budget shorter block.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from dflash import model as zlab
from flax import nnx
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from dspec.hf_import import load_hf_model
from dspec.models import dflash as dflash_lib
from dspec.models import dflash2, formats
from dspec.models.formats import dflash as dflash_formats

VOCAB, MASK, DEPTH, WIDTH = 128, 127, 6, 64
PROMPT_LEN = 11
SHAPES = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=96,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=5000.0,
              rms_norm_eps=1e-5)
SELECTOR = dict(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=6)
TOL = 1e-4

# name -> (z-lab class, draft layers, dflash_config, other Qwen3 config fields)
CASES = {
    'dflash_taps_b8': (zlab.DFlashDraftModel, 2,
                       dict(block_size=8, target_layer_ids=[1, 3, 5],
                            input_embedding_scale=1.5), {}),
    'dflash_default_taps_b16': (zlab.DFlashDraftModel, 3, dict(block_size=16),
                                dict(use_sliding_window=True, sliding_window=5,
                                     layer_types=['sliding_attention', 'full_attention',
                                                  'sliding_attention'])),
    'dflash_bidirectional_window_b8': (zlab.DFlashDraftModel, 2,
                                       dict(block_size=8, target_layer_ids=[4, 0, 2]),
                                       dict(use_sliding_window=True, sliding_window=3,
                                            is_causal=False,
                                            layer_types=['sliding_attention'] * 2)),
    'dflash2_softcap_multiplier_b8': (zlab.DFlash2DraftModel, 2,
                                      dict(block_size=8, output_multiplier=0.7,
                                           final_logit_softcapping=2.5, **SELECTOR), {}),
    'dflash2_sliding_b16': (zlab.DFlash2DraftModel, 2,
                            dict(block_size=16, target_layer_ids=[5, 1],
                                 final_logit_softcapping=4.0, **SELECTOR),
                            dict(use_sliding_window=True, sliding_window=6,
                                 layer_types=['sliding_attention', 'full_attention'])),
}


def _randomize(model, seed):
  """Weights with O(1) variation everywhere (z-lab leaves base_kernel uninitialised)."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if name.endswith('norm.weight'):
        p.copy_(1 + 0.2 * noise)
      elif 'base_kernel' in name:
        p.copy_(0.5 * noise)
      elif 'codebook' in name:
        p.copy_(noise)
      else:
        p.copy_(noise / p.shape[-1] ** 0.5)


@pytest.fixture(scope='module')
def root(tmp_path_factory):
  return tmp_path_factory.mktemp('parity')


@pytest.fixture(scope='module')
def target(root):
  """(HF target, dspec target, prompt+anchor ids [1, P+1], HF target dir)."""
  torch.manual_seed(0)
  hf = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=DEPTH, tie_word_embeddings=False,
                                    **SHAPES)).eval()
  _randomize(hf, 1)
  path = str(root / 'target')
  hf.save_pretrained(path)
  ours, _ = load_hf_model(path)
  ids = torch.randint(0, VOCAB - 1, (1, PROMPT_LEN + 1), generator=torch.Generator().manual_seed(2))
  return hf, ours, ids, path


def _zlab_drafter(root, name):
  cls, layers, draft_cfg, extra = CASES[name]
  config = Qwen3Config(num_hidden_layers=layers, num_target_layers=DEPTH,
                       dflash_config=dict(mask_token_id=MASK, **draft_cfg), **SHAPES, **extra)
  model = cls(config)
  _randomize(model, 3 + sorted(CASES).index(name))
  path = str(root / name)
  model.save_pretrained(path)
  return cls.from_pretrained(path).eval(), path


def _zlab_block(model, hf, ids, verify):
  """(draft logits [γ, V], draft hidden [1, γ, H]) of z-lab's drafter on the prompt."""
  p = ids.shape[1] - 1
  with torch.no_grad():
    out = hf(ids[:, :p], output_hidden_states=True)
    context = zlab.extract_context_feature(out.hidden_states, model.target_layer_ids)
    block = torch.full((1, verify), MASK)
    block[0, 0] = ids[0, p]
    scale = float(zlab._draft_value(model.config, 'input_embedding_scale', 1.0))
    hidden = model(target_hidden=context, position_ids=torch.arange(p + verify)[None],
                   noise_embedding=zlab._raw_input_embeddings(hf, block, scale))[:, 1:]
    return model.compute_logits(hidden, hf.lm_head)[0].numpy(), hidden


def _dspec_block(drafter, target, ids, block_size, verify):
  """dspec's draft logits [γ, V] and hidden [1, γ, H] of slots 1..verify−1, the block
  having `block_size` slots of which only `verify` exist (block_len)."""
  p = ids.shape[1] - 1
  tokens = jnp.asarray(ids.numpy(), jnp.int32)
  out = target(tokens[:, :p], taps=drafter.cfg.target_layer_ids, compute_logits=False)
  ctx_k, ctx_v = drafter.context_kv(drafter.fuse(out.taps_BTND, target),
                                    jnp.arange(p)[None])
  block = jnp.full((1, block_size), MASK, jnp.int32).at[0, 0].set(tokens[0, p])
  hidden = drafter(target.embed(block), p + jnp.arange(block_size)[None], ctx_k, ctx_v,
                   drafter.cfg.draft_masks(block_size), jnp.array([[p, verify]]))
  hidden = hidden[:, 1:verify]
  return np.asarray(drafter.draft_logits(target, hidden))[0], hidden


@pytest.mark.slow
@pytest.mark.parametrize('name', sorted(CASES))
def test_draft_logits_match_zlab(root, target, name):
  hf, ours, ids, _ = target
  model, path = _zlab_drafter(root, name)
  drafter = dflash_formats.load_dflash(path, num_target_layers=DEPTH)
  assert formats.detect(path) == 'zlab'
  big_b = CASES[name][2]['block_size']
  assert drafter.cfg.block_size == big_b
  assert list(drafter.cfg.target_layer_ids) == list(model.target_layer_ids)
  for verify in (big_b, 3):   # the full block, and z-lab's end-of-budget shorter block
    want, z_hidden = _zlab_block(model, hf, ids, verify)
    got, hidden = _dspec_block(drafter, ours, ids, big_b, verify)
    assert np.abs(want).max() > 0.5   # logits that discriminate
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    if isinstance(model, zlab.DFlash2DraftModel):
      anchor = ids[:, -1]
      z_tokens, _, _ = model.propose(z_hidden, anchor, hf.lm_head, 0.0)
      walk = dflash2.propose_block(drafter, ours, hidden, jnp.asarray(anchor.numpy()),
                                   greedy=True)
      np.testing.assert_array_equal(np.asarray(walk.tokens_BG), z_tokens.numpy())
      assert walk.q_BGK is None


def test_default_taps_are_zlabs():
  for depth, n in ((36, 5), (6, 3), (4, 2), (3, 2), (7, 1), (28, 4)):
    assert list(dflash_formats.zlab_target_layer_ids(depth, n)) == \
        zlab.build_target_layer_ids(depth, n)


@pytest.mark.slow
def test_sampled_selector_q_matches_zlab(root, target):
  """At T > 0 the q of every slot, given the path z-lab sampled, equals z-lab's q (as a
  distribution over candidate token ids), and dspec's own walk returns a normalised q
  whose sampled tokens lie in the candidates."""
  hf, ours, ids, _ = target
  name = 'dflash2_softcap_multiplier_b8'
  model, path = _zlab_drafter(root, name)
  drafter = dflash_formats.load_dflash(path)
  _, z_hidden = _zlab_block(model, hf, ids, 8)
  _, hidden = _dspec_block(drafter, ours, ids, 8, 8)
  anchor = ids[:, -1]
  temperature = 0.8
  torch.manual_seed(5)
  z_tokens, z_cand, z_q = model.propose(z_hidden, anchor, hf.lm_head, temperature)
  logits = drafter.draft_logits(ours, hidden)
  unary, cand = jax.lax.top_k(logits, drafter.cfg.selector_top_k)
  path_ids = jnp.asarray(z_tokens.numpy(), jnp.int32)
  prev = jnp.concatenate([jnp.asarray(anchor.numpy(), jnp.int32)[:, None],
                          path_ids[:, :-1]], axis=1)
  q = jax.nn.softmax(drafter.candidate_selector.scores(unary, hidden, prev, cand)
                     / temperature, axis=-1)
  for t in range(z_tokens.shape[1]):
    want = dict(zip(z_cand[0, t].tolist(), z_q[0, t].tolist()))
    got = dict(zip(np.asarray(cand[0, t]).tolist(), np.asarray(q[0, t]).tolist()))
    assert set(want) == set(got)
    for token, prob in want.items():
      assert abs(got[token] - prob) < TOL
  walk = dflash2.propose_block(drafter, ours, hidden, jnp.asarray(anchor.numpy()),
                               greedy=False, temperature=jnp.array([temperature]),
                               key=jax.random.key(0))
  np.testing.assert_allclose(np.asarray(walk.q_BGK.sum(-1)), 1.0, atol=1e-6)
  full = walk.q_over_vocab(VOCAB)
  np.testing.assert_allclose(np.asarray(full.sum(-1)), 1.0, atol=1e-6)
  assert np.all(np.take_along_axis(np.asarray(full), np.asarray(walk.tokens_BG)[..., None],
                                   -1) > 0)


@pytest.mark.slow
@pytest.mark.parametrize('kind', ['dflash', 'dflash2'])
def test_export_round_trip(root, target, kind):
  """A dspec drafter (random, from scratch) exported in z-lab form loads in z-lab's
  package and gives the same draft logits; reading the export back is lossless."""
  hf, ours, ids, _ = target
  config_class = dflash2.DFlash2Config if kind == 'dflash2' else dflash_lib.DFlashConfig
  drafter_class = dflash2.DFlash2Model if kind == 'dflash2' else dflash_lib.DFlashModel
  extra = SELECTOR if kind == 'dflash2' else {}
  cfg = config_class.create(num_target_layers=DEPTH, num_layers=2, block_size=8,
                            mask_token_id=MASK, target_layer_ids=(2, 4),
                            output_multiplier=0.9, final_logit_softcapping=3.0, **extra)
  drafter = drafter_class(cfg, ours.cfg, rngs=nnx.Rngs(7))
  if kind == 'dflash2':   # leave the identity init so the convs and walk matter
    for conv in list(drafter.attention_convs) + list(drafter.mlp_convs):
      conv.base_kernel[...] = jax.random.normal(jax.random.key(1), conv.base_kernel.shape)
      k = conv.kernel_projection.kernel
      k[...] = 0.1 * jax.random.normal(jax.random.key(2), k.shape)
  path = str(root / f'export_{kind}')
  dflash_formats.save_zlab(path, drafter)
  cls = zlab.DFlash2DraftModel if kind == 'dflash2' else zlab.DFlashDraftModel
  model = cls.from_pretrained(path).eval()
  want, z_hidden = _zlab_block(model, hf, ids, 8)
  got, hidden = _dspec_block(drafter, ours, ids, 8, 8)
  np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
  back, _ = _dspec_block(dflash_formats.load_dflash(path), ours, ids, 8, 8)
  np.testing.assert_array_equal(back, got)
  if kind == 'dflash2':
    z_tokens, _, _ = model.propose(z_hidden, ids[:, -1], hf.lm_head, 0.0)
    walk = dflash2.propose_block(drafter, ours, hidden, jnp.asarray(ids[:, -1].numpy()),
                                 greedy=True)
    np.testing.assert_array_equal(np.asarray(walk.tokens_BG), z_tokens.numpy())


def _speculators_dir(root, name, zlab_path, target_path, draft_vocab=None):
  """The z-lab drafter rewritten in speculators form (as speculators 0.9.0 saves it)."""
  config = json.load(open(os.path.join(zlab_path, 'config.json')))
  draft = config.pop('dflash_config')
  kind = 'dflash2' if config['architectures'] == ['DFlash2DraftModel'] else 'dflash'
  for key in ('architectures', 'num_target_layers', 'auto_map'):
    config.pop(key, None)
  taps = draft.get('target_layer_ids') or zlab.build_target_layer_ids(
      DEPTH, config['num_hidden_layers'])
  spec = dict(speculators_model_type=kind, architectures=['DFlashSpeculator'],
              transformer_layer_config=config, block_size=draft['block_size'],
              aux_hidden_state_layer_ids=[i + 1 for i in taps],
              mask_token_id=MASK, draft_vocab_size=VOCAB, sample_from_anchor=False,
              sliding_window_non_causal=kind == 'dflash2', target_hidden_size=None,
              speculators_config={'algorithm': kind, 'verifier': {
                  'name_or_path': target_path, 'architectures': ['Qwen3ForCausalLM']}})
  if kind == 'dflash2':
    spec.update({k: draft[k] for k in SELECTOR})
  tensors = load_file(os.path.join(zlab_path, 'model.safetensors'))
  tensors = {k[:-len('.weight')] if '_codebook' in k else k: v for k, v in tensors.items()}
  if draft_vocab is not None:
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[draft_vocab] = True
    spec['draft_vocab_size'] = len(draft_vocab)
    tensors['t2d'] = t2d
    tensors['d2t'] = torch.tensor(draft_vocab) - torch.arange(len(draft_vocab))
    tensors['lm_head.weight'] = torch.zeros(len(draft_vocab), WIDTH)
  path = root / f'speculators_{name}'
  path.mkdir(exist_ok=True)
  save_file(tensors, str(path / 'model.safetensors'), metadata={'format': 'pt'})
  (path / 'config.json').write_text(json.dumps(spec))
  return str(path)


@pytest.mark.slow
def test_speculators_form(root, target):
  """speculators dflash (reduced vocabulary via t2d/d2t, taps as aux hidden-state
  indices) and dflash2 (bare codebook names, bidirectional sliding layers) load and match
  z-lab's drafter on the same weights."""
  hf, ours, ids, target_path = target
  model, path = _zlab_drafter(root, 'dflash_taps_b8')
  draft_vocab = list(range(0, VOCAB, 3))
  spec_path = _speculators_dir(root, 'dflash', path, target_path, draft_vocab)
  assert formats.detect(spec_path) == 'speculators'
  drafter = dflash_formats.load_dflash(spec_path)
  assert drafter.cfg.draft_vocab == tuple(draft_vocab)
  # speculators has no embedding scale or logit transforms: z-lab's drafter without them.
  model.config.dflash_config.pop('input_embedding_scale')
  want, _ = _zlab_block(model, hf, ids, 8)
  got, _ = _dspec_block(drafter, ours, ids, 8, 8)
  np.testing.assert_allclose(got, want[:, draft_vocab], atol=TOL, rtol=0)

  model, path = _zlab_drafter(root, 'dflash2_softcap_multiplier_b8')
  drafter = dflash_formats.load_dflash(_speculators_dir(root, 'dflash2', path, target_path))
  assert isinstance(drafter, dflash2.DFlash2Model)
  model.config.dflash_config.pop('output_multiplier')
  model.config.dflash_config.pop('final_logit_softcapping')
  want, _ = _zlab_block(model, hf, ids, 8)
  got, _ = _dspec_block(drafter, ours, ids, 8, 8)
  np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


@pytest.mark.slow
def test_load_drafter_detects_dspec_checkpoints(root, target):
  _, ours, _, _ = target
  for config_class, drafter_class in ((dflash_lib.DFlashConfig, dflash_lib.DFlashModel),
                                      (dflash2.DFlash2Config, dflash2.DFlash2Model)):
    cfg = config_class.create(num_target_layers=DEPTH, num_layers=1, block_size=4,
                              mask_token_id=MASK)
    drafter = drafter_class(cfg, ours.cfg, rngs=nnx.Rngs(0))
    path = str(root / f'dspec_{drafter.checkpoint_kind}')
    dflash_lib.save_dflash(path, drafter)
    assert formats.detect(path) == 'dspec'
    loaded = dflash_formats.load_dflash(path, attention_impl='xla')
    assert type(loaded) is drafter_class and loaded.cfg == cfg


def _edit_config(root, name, src, edit):
  path = root / name
  path.mkdir(exist_ok=True)
  config = json.load(open(os.path.join(src, 'config.json')))
  edit(config)
  (path / 'config.json').write_text(json.dumps(config))
  tensors = load_file(os.path.join(src, 'model.safetensors'))
  save_file(tensors, str(path / 'model.safetensors'), metadata={'format': 'pt'})
  return str(path), tensors


def test_format_errors_name_key_and_file(root):
  _, src = _zlab_drafter(root, 'dflash2_softcap_multiplier_b8')
  cases = [
      (lambda c: c['dflash_config'].pop('mask_token_id'), "'dflash_config.mask_token_id'"),
      (lambda c: c['dflash_config'].pop('selector_rank'), "'dflash_config.selector_rank'"),
      (lambda c: c.pop('num_target_layers'), "'num_target_layers'"),
      (lambda c: c.update(architectures=['LlamaForCausalLM']), "'architectures'"),
      (lambda c: c['dflash_config'].update(block_size='8'), "'dflash_config.block_size'"),
      (lambda c: c.update(layer_types=['full_attention']), "'layer_types'"),
      (lambda c: c.update(hidden_act='gelu'), "'hidden_act'"),
  ]
  for i, (edit, key) in enumerate(cases):
    path, _ = _edit_config(root, f'bad{i}', src, edit)
    with pytest.raises(formats.FormatError) as err:
      dflash_formats.load_dflash(path)
    message = str(err.value)
    assert key in message and 'config.json' in message and '\n' not in message, message

  path, tensors = _edit_config(root, 'bad_tensor', src, lambda c: None)
  tensors['fc.weight'] = tensors['fc.weight'][:, :-1].contiguous()
  save_file(tensors, os.path.join(path, 'model.safetensors'), metadata={'format': 'pt'})
  with pytest.raises(formats.FormatError, match=r"model.safetensors: tensor "
                     r"'fc.weight' has shape"):
    dflash_formats.load_dflash(path)
  with pytest.raises(formats.FormatError, match="'num_target_layers' is 6 but"):
    dflash_formats.load_dflash(src, num_target_layers=8)
