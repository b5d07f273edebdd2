"""EAGLE-3 directories as speculators itself writes them (`Eagle3DraftModel.save_pretrained`
on random weights): dspec loads each and its training-time-test logits equal speculators'
`forward` on the same weights, for the forms `speculators train` produces."""

import numpy as np
import pytest

from conftest import TINY
from dspec.models.formats.eagle3 import load_eagle3, speculators_config
from dspec.models.eagle3 import Eagle3Config, Eagle3Model
from speculators_import import speculators_module
from flax import nnx

STEPS, T = 3, 12


def _config(aux=(2, 1, 2), **changes) -> dict:
  """speculators' config of a TINY-target drafter; `changes` update its top level, and its
  layer config under the key 'layer'."""
  model = nnx.eval_shape(lambda: Eagle3Model(
      Eagle3Config(target_layer_ids=tuple(a - 1 for a in aux), final_tap_normed=True), TINY,
      rngs=nnx.Rngs(0)))
  config = speculators_config(model)
  config['eagle_aux_hidden_state_layer_ids'] = list(aux)
  config['transformer_layer_config'].update(changes.pop('layer', {}))
  config.update(changes)
  return config


def _saved_reference(path, config: dict, target, seed: int = 0):
  """speculators' Eagle3DraftModel of `config` with random weights, saved by
  `save_pretrained` into `path`; returns it (eager attention). Its embedding is random with
  embed_requires_grad, else the target's (speculators' frozen verifier copy)."""
  import torch
  spec = speculators_module('models.eagle3')
  config = spec.Eagle3SpeculatorConfig(**config)
  config.transformer_layer_config._attn_implementation = 'eager'
  ref = spec.Eagle3DraftModel(config)
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in ref.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      p.copy_(1 + 0.1 * noise if name.endswith('norm.weight') else
              noise / p.shape[-1] ** 0.5 * (3.0 if 'down_proj' in name else 1.0))
    if not config.embed_requires_grad:
      ref.embed_tokens.weight.copy_(torch.tensor(np.asarray(target.embed_tokens[...])))
  ref.save_pretrained(str(path))
  return ref.eval()


def _hf_hidden_states(target, tokens_BT):
  """HF's hidden_states of the target: [embeddings, layer 0 .. L-2 outputs, final-normed
  layer L-1 output] ([L+1] arrays [B, T, H])."""
  layers = tuple(range(TINY.num_layers))
  out = target(tokens_BT, taps=layers)
  outs = [out.taps_BTND[:, :, i] for i in layers]
  return [target.embed(tokens_BT)] + outs[:-1] + [target.norm(outs[-1])]


def _assert_ttt_parity(target, ref, model, aux):
  """dspec's TTT logits of `model` equal speculators' forward of `ref` at every step."""
  import torch
  tokens = np.random.default_rng(0).integers(0, TINY.vocab_size, (1, T + 1)).astype(np.int32)
  hidden = _hf_hidden_states(target, tokens[:, :T])
  taps = target(tokens[:, :T], taps=model.cfg.target_layer_ids).taps_BTND
  ours = model.ttt_logits(target, model.fuse(taps, target), tokens, STEPS)
  captured = []
  ref.lm_head.register_forward_hook(lambda m, i, o: captured.append(o.detach().numpy()))
  fused_in = np.concatenate([np.asarray(hidden[a]) for a in aux], axis=-1)
  with torch.no_grad():
    ref(torch.from_numpy(fused_in), torch.from_numpy(tokens[:, 1:].astype(np.int64)),
        torch.zeros((1, T), dtype=torch.long), ttt_steps=STEPS)
  assert len(captured) == STEPS
  for s in range(STEPS):
    np.testing.assert_allclose(np.asarray(ours[s]), captured[s], atol=1e-4, rtol=1e-4)


def test_own_embedding_is_the_drafts_embedding(tiny_model, tmp_path):
  """embed_requires_grad: the checkpoint's trained embed_tokens (not the target's) embeds
  the draft tokens."""
  ref = _saved_reference(tmp_path, _config(embed_requires_grad=True), tiny_model)
  model = load_eagle3(str(tmp_path), target_cfg=TINY)
  assert model.cfg.own_embedding
  np.testing.assert_array_equal(np.asarray(model.embed_tokens[...]),
                                ref.embed_tokens.weight.detach().numpy())
  _assert_ttt_parity(tiny_model, ref, model, (2, 1, 2))


# speculators train's default draft: Llama layers, every one sliding (window 2048 there; a
# window shorter than the test sequence here, so that it matters).
SLIDING = dict(model_type='llama', sliding_window=4, use_sliding_window=True)


@pytest.mark.parametrize('layers', [1, 2])
def test_sliding_attention_layers_keep_their_window(tiny_model, tmp_path, layers):
  types = ['sliding_attention'] + ['full_attention'] * (layers - 1)
  config = _config(layer=dict(SLIDING, num_hidden_layers=layers, layer_types=types))
  ref = _saved_reference(tmp_path, config, tiny_model)
  model = load_eagle3(str(tmp_path), target_cfg=TINY)
  assert model.cfg.layer_types == tuple(types) and model.cfg.sliding_window == 4
  assert not model.layer_cfg.qk_norm
  _assert_ttt_parity(tiny_model, ref, model, (2, 1, 2))


def test_speculators_train_default_config_loads(tiny_model, tmp_path):
  """The layer config `speculators train` writes by default (window 2048) is honoured."""
  _saved_reference(tmp_path, _config(layer=dict(SLIDING, sliding_window=2048,
                                                layer_types=['sliding_attention'])),
                   tiny_model)
  model = load_eagle3(str(tmp_path), target_cfg=TINY)
  assert model.cfg.layer_types == ('sliding_attention',)
  assert model.cfg.sliding_window == 2048


def test_aux_layer_zero_taps_the_embedding_output(tiny_model, tmp_path):
  ref = _saved_reference(tmp_path, _config(aux=(0, 1, 2)), tiny_model)
  model = load_eagle3(str(tmp_path), target_cfg=TINY)
  assert model.cfg.target_layer_ids == (-1, 0, 1)
  _assert_ttt_parity(tiny_model, ref, model, (0, 1, 2))


def test_own_embedding_round_trips(tiny_model, tmp_path):
  """dspec writes an own-embedding drafter with embed_requires_grad and its embed_tokens;
  both its speculators form and its dspec checkpoint load the same weights back."""
  import jax
  from dspec.models.eagle3 import save_eagle3
  from dspec.models.formats.eagle3 import save_speculators
  model = Eagle3Model(Eagle3Config(target_layer_ids=(1, 0), own_embedding=True,
                                   final_tap_normed=True), TINY, rngs=nnx.Rngs(2))
  save_speculators(tmp_path / 'spec', model)
  save_eagle3(tmp_path / 'dspec', model)
  for form in ('spec', 'dspec'):
    loaded = load_eagle3(str(tmp_path / form), target_cfg=TINY)
    assert loaded.cfg == model.cfg
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                    jax.tree.leaves(nnx.state(loaded, nnx.Param))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
