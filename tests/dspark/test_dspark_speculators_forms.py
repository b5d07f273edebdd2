"""DSpark directories as speculators itself writes them (`DSparkDraftModel.save_pretrained`
on random weights) in two forms speculators reloads: a reduced draft vocabulary (t2d / d2t)
and draft layers whose config names llama. dspec loads each; its block hidden states, draft
logits, confidence logits and greedy Markov walk equal speculators' modules on the same
weights, and greedy decoding with it equals AR."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import TINY, generate
from dspec.decoding.drafters.dspark import DSparkDrafter
from dspec.decoding.engine import SpeculativeEngine
from dspec.models import dspark
from dspec.models.formats.dspark import load_dspark, speculators_config
from speculators_import import speculators_module

BLOCK, RANK, MASK = 4, 6, 63
DRAFT_IDS = np.arange(1, 64, 3)          # a reduced draft vocabulary of 21 target ids
PROMPT = [3, 4, 5, 6, 3, 4, 5, 6, 3]
CASES = {
    'reduced_vocab': (dict(draft_vocab_size=len(DRAFT_IDS)), DRAFT_IDS),
    'llama_layers': (dict(markov_head_type='gated', layer=dict(model_type='llama')), None),
}


def _config(layer=None, **changes) -> dict:
  """speculators' config of a TINY-target DSpark; `changes` update its top level and
  `layer` its transformer_layer_config."""
  cfg = dspark.DSparkConfig.create(TINY.num_layers, num_layers=1, block_size=BLOCK,
                                   mask_token_id=MASK, target_layer_ids=(0, 1),
                                   markov_rank=RANK, layer_types=('full_attention',),
                                   final_tap_normed=True)
  config = speculators_config(nnx.eval_shape(
      lambda: dspark.DSparkModel(cfg, TINY, rngs=nnx.Rngs(0))))
  config['transformer_layer_config'].update(layer or {})
  config.update(changes)
  return config


def _saved_reference(path, config: dict, draft_ids, target):
  """speculators' DSparkDraftModel with random weights (the verifier's embedding and head
  rows from `target`), saved by `save_pretrained` into `path` (eager attention)."""
  import torch
  spec = speculators_module('models.dspark')
  config = spec.DSparkSpeculatorConfig(**config)
  config.transformer_layer_config._attn_implementation = 'eager'
  ref = spec.DSparkDraftModel(config)
  head_VD = np.asarray(target.lm_head[...]).T
  if draft_ids is not None:
    t2d = torch.zeros(TINY.vocab_size, dtype=torch.bool)
    t2d[torch.from_numpy(draft_ids)] = True
    ref.load_vocab_mappings(t2d, torch.from_numpy(draft_ids - np.arange(len(draft_ids))))
    head_VD = head_VD[draft_ids]
  gen = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for name, p in ref.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      p.copy_(1 + 0.1 * noise if name.endswith('norm.weight') else
              noise / max(p.shape[-1], 1) ** 0.5 * (3.0 if 'markov_w2' in name else 1.0))
    ref.embed_tokens.weight.copy_(torch.tensor(np.asarray(target.embed_tokens[...])))
    ref.lm_head.weight.copy_(torch.tensor(head_VD.copy()))
  ref.save_pretrained(str(path))
  return ref.eval()


def _reference_block(ref, target, tokens, draft_ids):
  """speculators' modules drafting one block after `tokens[:-1]` (anchor tokens[-1]):
  (hidden [1, B, H], tokens [1, B] target ids, confidence logits [1, B])."""
  import torch
  p = len(tokens) - 1
  layers = tuple(range(TINY.num_layers))
  taps = np.asarray(target(jnp.asarray([tokens[:p]]), taps=layers).taps_BTND)
  hf = [None] + [taps[:, :, i] for i in layers[:-1]] + \
      [np.asarray(target.norm(jnp.asarray(taps[:, :, -1])))]
  ctx = np.concatenate([hf[a] for a in ref.config.aux_hidden_state_layer_ids], axis=-1)
  with torch.no_grad():
    fused = ref.hidden_norm(ref.fc(torch.from_numpy(ctx)))
    block = torch.full((1, BLOCK), MASK)
    block[0, 0] = tokens[p]
    x = ref.embed_tokens(block)
    positions = torch.arange(p + BLOCK)[None]
    rope = ref.rotary_emb(x, positions)
    for layer in ref.layers:
      x = layer(target_hidden=fused, hidden_states=x, attention_mask=None,
                position_ids=positions, position_embeddings=rope)
    hidden = ref.norm(x)
    base = ref.lm_head(hidden)
    prev, out, conf = torch.tensor([[tokens[p]]]), [], []
    for k in range(BLOCK):
      emb = ref.markov_head.prev_embeddings(prev)
      logits = base[:, k:k + 1] + ref.markov_head.block_bias(
          prev_token_ids=prev, hidden_states=hidden[:, k:k + 1], prev_emb=emb)
      conf.append(ref.confidence_head(torch.cat([hidden[:, k:k + 1], emb], -1))[0, 0])
      index = int(torch.argmax(logits))
      prev = torch.tensor([[index if draft_ids is None else int(draft_ids[index])]])
      out.append(int(prev))
  return hidden.numpy(), np.array([out]), np.array([[float(c) for c in conf]])


def _dspec_block(model, target, tokens):
  """dspec's block hidden [1, B, H] and Markov walk after `tokens[:-1]`."""
  p = len(tokens) - 1
  ids = jnp.asarray([tokens], jnp.int32)
  out = target(ids[:, :p], taps=model.cfg.target_layer_ids, compute_logits=False)
  ctx_k, ctx_v = model.context_kv(model.fuse(out.taps_BTND, target), jnp.arange(p)[None])
  block = jnp.full((1, BLOCK), MASK, jnp.int32).at[0, 0].set(tokens[p])
  hidden = model(target.embed(block), p + jnp.arange(BLOCK)[None], ctx_k, ctx_v,
                 model.cfg.draft_masks(BLOCK), jnp.array([[p, BLOCK]]))
  return hidden, model.walk(target, hidden, ids[:, p])


def test_a_speculators_dspark_directory_loads_with_its_config(tiny_model, tmp_path):
  """The quick check's part of the test below (no forward pass): speculators' own
  directory, with a reduced draft vocabulary, loads into the DSpark config it was made
  from."""
  changes, draft_ids = CASES['reduced_vocab']
  _saved_reference(tmp_path, _config(**changes), draft_ids, tiny_model)
  model = load_dspark(str(tmp_path), num_target_layers=TINY.num_layers)
  assert model.cfg.draft_vocab == tuple(draft_ids)
  assert (model.cfg.block_size, model.cfg.mask_token_id, model.cfg.markov_rank,
          model.cfg.target_layer_ids) == (BLOCK, MASK, RANK, (0, 1))


@pytest.mark.slow
@pytest.mark.parametrize('name', sorted(CASES))
def test_speculators_dspark_forms_load_with_parity(tiny_model, tiny_split, tmp_path, name):
  changes, draft_ids = CASES[name]
  ref = _saved_reference(tmp_path, _config(**changes), draft_ids, tiny_model)
  model = load_dspark(str(tmp_path), num_target_layers=TINY.num_layers)
  assert model.cfg.draft_vocab == (() if draft_ids is None else tuple(draft_ids))
  for tokens in (PROMPT, [9, 1, 30, 2, 7]):
    want_hidden, want_tokens, want_conf = _reference_block(ref, tiny_model, tokens, draft_ids)
    hidden, walk = _dspec_block(model, tiny_model, tokens)
    np.testing.assert_allclose(np.asarray(hidden), want_hidden, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(np.asarray(walk.tokens_BG), want_tokens)
    np.testing.assert_allclose(np.asarray(walk.conf_logits_BG), want_conf, atol=1e-4)
  drafter, params = DSparkDrafter.create(model)
  engine = SpeculativeEngine(tiny_split[0], drafter=drafter)
  ar = generate(SpeculativeEngine(tiny_split[0]), tiny_split[1], None, [PROMPT], 16)[0]
  outs, state = generate(engine, tiny_split[1], params, [PROMPT], 16)
  assert outs == ar
  assert int(np.asarray(state.stats.proposed_B).sum()) > 0
