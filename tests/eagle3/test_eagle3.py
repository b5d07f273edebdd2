"""EAGLE-3: drafting = training-time test, lossless decoding, formats, speculators parity."""

import copy
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from conftest import TINY, generate, greedy_rows
from dspec.decoding.drafters import registry
from dspec.decoding.drafters.eagle3 import Eagle3Drafter
from dspec.decoding.engine import SpeculativeEngine
from dspec.sampling import SamplingSpec
from dspec.decoding.state import DraftContext
from dspec.models.config import TransformerConfig
from dspec.models.eagle3 import Eagle3Config, Eagle3Model, save_eagle3
from dspec.models.formats.eagle3 import load_eagle3, save_speculators
from dspec import checkpoint
from dspec.models.transformer import TargetOutput, Transformer
from lossless_checks import check_engine_samples_match_target
from speculators_import import speculators_module

PROMPTS = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [9]]
NEW_TOKENS = 20
TAPS = (1, 0, 1)
VOCAB = tuple(range(0, 64, 2)) + tuple(range(1, 20, 2))   # a reduced head (sorted below)


def random_eagle3(target, seed=1, scale=10.0, target_cfg=TINY, **fields):
  """A random EAGLE-3 whose layer matters (larger MLP outputs than the 0.02 init)."""
  fields = dict(dict(target_layer_ids=TAPS, draft_vocab=tuple(sorted(VOCAB)),
                     final_tap_normed=True), **fields)
  model = Eagle3Model(Eagle3Config(**fields), target_cfg, rngs=nnx.Rngs(seed))
  model.init_head_from(target)
  for layer in model.layers:
    layer.mlp.down_proj.kernel[...] *= scale
  return model


def params_equal(a: Eagle3Model, b: Eagle3Model):
  for x, y in zip(jax.tree.leaves(nnx.state(a, nnx.Param)),
                  jax.tree.leaves(nnx.state(b, nnx.Param))):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- drafting == TTT pass

CONSISTENCY = [
    dict(),
    dict(num_layers=2, draft_vocab=(), norm_before_residual=True, fc_norm=True,
         norm_output=True),
    # a sliding window shorter than the context, the embedding tapped, its own embedding
    dict(num_layers=2, layer_types=('sliding_attention', 'full_attention'),
         sliding_window=3, target_layer_ids=(-1, 1), own_embedding=True),
]


@pytest.mark.slow
@pytest.mark.parametrize('fields', CONSISTENCY, ids=['reduced_vocab', 'options', 'window'])
def test_catch_up_and_drafting_match_ttt(tiny_model, fields):
  """After prefill and catch-ups with varied acceptance (garbage verify taps at rejected
  slots), draft k's logits equal TTT step k-1 at index n-2 over the committed tokens
  followed by the earlier drafts. Idle updates (the controller's AR tier: record only) are
  written by `sync` before drafting, over more positions than one window."""
  target = tiny_model
  model = random_eagle3(target, **fields)
  gamma = 3
  drafter, params = Eagle3Drafter.create(model, gamma)
  rng = np.random.default_rng(0)
  b, length = 2, 40
  seq = rng.integers(1, 64, (b, length)).astype(np.int32)
  full = jax.jit(lambda t, s: t(s, taps=drafter.taps))(target, seq)

  def ctx_of(tokens, n):
    tokens = jnp.where(jnp.arange(length)[None] < n[:, None], tokens, 0)
    return DraftContext(tokens, n, SamplingSpec(), jnp.float32(0), jnp.float32(1))

  init = jax.jit(lambda p, t, s, n, out: drafter.init(p, t, ctx_of(s, n), out))
  update, idle_update = (jax.jit(lambda p, st, t, s, n, out, start, fn=fn: fn(
      p, st, t, ctx_of(s, n), out, start, None)) for fn in (drafter.update,
                                                            drafter.idle_update))
  draft = jax.jit(lambda p, st, t, s, n: drafter.draft(
      p, drafter.sync(p, st, t, ctx_of(s, n)), t, ctx_of(s, n), jax.random.key(0))[:2])

  @jax.jit
  def reference(m, t, taps, seq_BL, n_B):
    outs = m.ttt_logits(t, m.fuse(taps, t), seq_BL, gamma)
    rows = jnp.arange(seq_BL.shape[0])
    return jnp.stack([o[rows, n_B - 2] for o in outs], axis=1)

  n = np.array([5, 2], np.int32)
  w = n.max() - 1
  state = init(params, target, seq, n,
               TargetOutput(None, full.hidden_BTD[:, :w], full.taps_BTND[:, :w], None))
  for accepted in [[2, 0], *['idle'] * 5, [0, 3], [3, 1], 'idle', [1, 2], None]:
    drafts, logits = draft(params, state, target, seq, n)
    with_drafts = np.zeros_like(seq)
    for r in range(b):
      row = np.concatenate([seq[r, :n[r]], np.asarray(drafts[r])])
      with_drafts[r, :len(row)] = row
    ref = reference(model, target, full.taps_BTND, jnp.asarray(with_drafts), jnp.asarray(n))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=1e-5, rtol=1e-5)
    if accepted is None:
      break
    a = np.zeros(b, np.int32) if accepted == 'idle' else np.array(accepted, np.int32)
    start = n - 1
    idx = start[:, None] + np.arange(gamma + 1)[None]
    rejected = np.arange(gamma + 1)[None] > a[:, None]
    noise = rng.normal(size=(b, gamma + 1, 1, TINY.embed_dim)).astype(np.float32)
    taps = np.where(rejected[..., None, None], noise,
                    np.asarray(full.taps_BTND)[np.arange(b)[:, None], idx])
    lengths = np.asarray(state.cache.lengths_B)
    n = n + a + 1
    step = idle_update if accepted == 'idle' else update
    state = step(params, state, target, seq, n,
                 TargetOutput(None, None, jnp.asarray(taps), None), jnp.asarray(start))
    want = lengths if accepted == 'idle' else n - 1    # an idle update only records
    assert np.asarray(state.cache.lengths_B).tolist() == want.tolist()


# ------------------------------------------------------------------- greedy lossless


@pytest.fixture(scope='module')
def ar_outputs(tiny_split):
  engine = SpeculativeEngine(tiny_split[0])
  return generate(engine, tiny_split[1], None, PROMPTS, NEW_TOKENS)[0]


@pytest.mark.slow
def test_greedy_equals_ar_through_every_format(tiny_split, tiny_model, ar_outputs,
                                               tmp_path):
  """dspec checkpoint, speculators and legacy directories load the same weights, and
  decoding with them through the registry is token-for-token AR."""
  model = random_eagle3(tiny_model)
  save_eagle3(tmp_path / 'dspec', model)
  save_speculators(tmp_path / 'spec', model)
  _legacy_from_speculators(tmp_path / 'spec', tmp_path / 'legacy')
  for kind in ('dspec', 'spec', 'legacy'):
    params_equal(model, load_eagle3(str(tmp_path / kind), target_cfg=TINY, taps=TAPS))
  cfg = _with_path(str(tmp_path / 'spec'))
  drafter, params = registry.build_drafter(cfg, tiny_model)
  engine = SpeculativeEngine(tiny_split[0], drafter=drafter)
  outs, state = generate(engine, tiny_split[1], params, PROMPTS, NEW_TOKENS)
  assert outs == ar_outputs
  assert int(np.asarray(state.stats.proposed_B).sum()) > 0


def _with_path(path):
  cfg = ml_collections.ConfigDict({'drafter': 'eagle3',
                                   'drafters': copy.deepcopy(registry.DEFAULTS)})
  cfg.drafters.eagle3.path = path
  cfg.drafters.eagle3.num_draft = 3
  return cfg


def _legacy_from_speculators(src, dst):
  """SafeAILab / SpecForge layout: `midlayer.*` tensors and a flat Llama-style config."""
  os.makedirs(dst)
  tensors = load_file(os.path.join(src, 'model.safetensors'))
  save_file({k.replace('layers.0.', 'midlayer.'): v for k, v in tensors.items()},
            os.path.join(dst, 'model.safetensors'))
  spec = json.load(open(os.path.join(src, 'config.json')))
  layer = spec['transformer_layer_config']
  config = dict(architectures=['LlamaForCausalLMEagle3'], model_type=layer['model_type'],
                **{k: layer[k] for k in ('hidden_size', 'num_attention_heads',
                                         'num_key_value_heads', 'head_dim',
                                         'intermediate_size', 'rms_norm_eps', 'vocab_size')},
                rope_theta=10000.0, draft_vocab_size=spec['draft_vocab_size'])
  json.dump(config, open(os.path.join(dst, 'config.json'), 'w'))


# ------------------------------------------------------------------- sampled lossless


@pytest.mark.slow
def test_sampled_lossless(small_vocab_model):
  """T = 1, sampled proposals with their q over a reduced head (so q misses tokens the
  target can emit): the first token and the 3-token joint follow the target."""
  graphdef, params = nnx.split(small_vocab_model)
  model = random_eagle3(small_vocab_model, target_cfg=small_vocab_model.cfg, scale=30.0,
                        target_layer_ids=(0, 1), draft_vocab=(0, 2, 3, 5, 7, 8, 11))
  drafter, dparams = Eagle3Drafter.create(model, 2, sample_proposals=True)
  engine = SpeculativeEngine(graphdef, drafter=drafter, sampling=SamplingSpec(greedy=False))
  check_engine_samples_match_target(engine, small_vocab_model, params, dparams,
                                    [1, 5, 2, 7], temperature=1.0, num_samples=40_000,
                                    num_tokens=3)


# ------------------------------------------------------------------ speculators parity


def _speculators():
  """speculators' EAGLE-3 definition."""
  return speculators_module('models.eagle3')


@pytest.mark.slow
@pytest.mark.parametrize('fields', [dict(), dict(norm_before_fc=True, norm_output=True,
                                                norm_before_residual=True)],
                         ids=['default', 'options'])
def test_ttt_logits_match_speculators(tiny_model, tmp_path, fields):
  """Same random weights (through the speculators directory dspec writes): every TTT
  step's draft logits equal speculators' Eagle3DraftModel.forward within 1e-4."""
  import torch
  spec = _speculators()
  model = random_eagle3(tiny_model, **fields)
  save_speculators(tmp_path, model)
  config = spec.Eagle3SpeculatorConfig.from_pretrained(str(tmp_path))
  config.transformer_layer_config._attn_implementation = 'eager'
  ref = spec.Eagle3DraftModel(config)
  state = {k: torch.from_numpy(v) for k, v in load_file(tmp_path / 'model.safetensors').items()}
  state['embed_tokens.weight'] = torch.tensor(np.asarray(tiny_model.embed_tokens[...]))
  missing, unexpected = ref.load_state_dict(state, strict=False)
  assert not unexpected and set(missing) <= {'verifier_lm_head.weight', 'verifier_norm.weight'}
  ref.eval()

  t, steps = 12, 3
  tokens = np.random.default_rng(0).integers(0, 64, (1, t + 1)).astype(np.int32)
  taps = tiny_model(tokens[:, :t], taps=TAPS).taps_BTND
  ours = model.ttt_logits(tiny_model, model.fuse(taps, tiny_model), tokens, steps)
  # speculators' aux hidden state L (tap layer 1 = TAPS[0], TAPS[2]) is HF's post-norm.
  aux = np.asarray(taps.at[:, :, ::2].set(tiny_model.norm(taps[:, :, ::2])))
  captured = []
  ref.lm_head.register_forward_hook(lambda m, i, o: captured.append(o.detach().numpy()))
  with torch.no_grad():
    ref(torch.from_numpy(aux.reshape(1, t, -1).copy()),
        torch.from_numpy(tokens[:, 1:].astype(np.int64)),
        torch.zeros((1, t), dtype=torch.long), ttt_steps=steps)
  assert len(captured) == steps
  for s in range(steps):
    np.testing.assert_allclose(np.asarray(ours[s]), captured[s], atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------ bad input


def test_mismatched_checkpoints_give_one_line(tiny_model, tmp_path):
  model = random_eagle3(tiny_model)
  save_speculators(tmp_path / 'spec', model)
  wide = TransformerConfig(**dict(TINY.to_dict(), embed_dim=48))
  with pytest.raises(ValueError, match='hidden size 32 does not match the target width 48'):
    load_eagle3(str(tmp_path / 'spec'), target_cfg=wide)
  config_path = tmp_path / 'spec' / 'config.json'
  config = json.loads(config_path.read_text())
  config['eagle_aux_hidden_state_layer_ids'] = [1, 2]
  config_path.write_text(json.dumps(config))
  with pytest.raises(ValueError, match='fuses 3 taps .* names 2 tap layers') as e:
    load_eagle3(str(tmp_path / 'spec'), target_cfg=TINY)
  assert '\n' not in str(e.value)
  config['eagle_aux_hidden_state_layer_ids'] = [1, 2, 5]
  config_path.write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r'\[1, 2, 5\] .* \[0, 2\] of the 2-layer target'):
    load_eagle3(str(tmp_path / 'spec'), target_cfg=TINY)
  save_eagle3(tmp_path / 'dspec', model)
  drafter, _ = Eagle3Drafter.create(load_eagle3(str(tmp_path / 'dspec')))
  with pytest.raises(ValueError, match='width 32 does not match the target width 48'):
    drafter.check_target(wide)
  with pytest.raises(ValueError, match='2-layer target, but the target has 3 layers'):
    drafter.check_target(TransformerConfig(**dict(TINY.to_dict(), num_layers=3)))
  with pytest.raises(ValueError, match='drafters.eagle3.path'):
    registry.build_drafter(_with_path(''), tiny_model)


# ------------------------------------------------------------------------- training


@pytest.mark.slow
def test_training_lowers_loss_and_exports(tiny_model, tmp_path, capsys):
  """TTT training (3 steps, reduced head from the written-token counts) on the tiny
  target's own outputs lowers every step's loss; the export loads as a drafter and records
  its target, so loading it against another target warns."""
  from configs import eagle3_demo
  from dspec.training import eagle3_task, trainer
  cfg = eagle3_demo.get_config('tiny,vocab=40')
  cfg.training.update(num_steps=60, batch_size=8, eval_every=60, log_every=60,
                      ckpt_every=1000, eval_windows=8)
  tokens, loss_mask = greedy_rows(tiny_model, new=22)
  task = eagle3_task.make_task(cfg, tiny_model, tokens, loss_mask)
  assert len(task.model.cfg.draft_vocab) == 40
  before = task.evaluate(task.model, tiny_model)
  after = trainer.train(task, cfg.training, str(tmp_path))['eval']
  assert after['loss'] < before['loss'] - 0.5, (before, after)
  assert after['acc0'] > before['acc0'] and after['tau_est'] > before['tau_est']
  drafter, _ = Eagle3Drafter.create(load_eagle3(str(tmp_path / 'final')))
  assert drafter.num_draft == 3 and drafter.taps == (1, 0, 1)
  record = checkpoint.read_model_metadata(str(tmp_path / 'final'), 'eagle3')['extra']
  assert record['target_sha256'] == checkpoint.weights_fingerprint(tiny_model)
  capsys.readouterr()
  other = Transformer(TINY, rngs=nnx.Rngs(7))
  registry.build_drafter(_with_path(str(tmp_path / 'final')), other)
  err = capsys.readouterr().err
  assert err.startswith('warning: ') and record['target_sha256'][:12] in err

