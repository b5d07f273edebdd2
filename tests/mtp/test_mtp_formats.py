"""Published MTP weights: speculators `mtp` form and HF checkpoints with DeepSeek-V3-layout
MTP layers, imported as dspec's chained MTP drafter.

Parity: the same random weights give dspec's depth logits equal to speculators'
`MTPDraftModel.forward` (read from a directory speculators itself saved) and to a torch
reference of DeepSeek-V3's formula built from transformers' Qwen3 decoder layer (read by
the DeepSeek tensor names), within 1e-4. Also: speculators-form round trip (API and
scripts/export_drafter.py), the target
loading from the same HF directory, greedy decoding == AR through the registry and the
CLI, and bad input as one line naming the key / tensor and the file.
"""

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
from safetensors.numpy import load_file, save_file

from conftest import REPO_ROOT, TINY, generate
from dspec import hf_import
from dspec.checkpoint import leaf_paths
from dspec.decoding.drafters import registry
from dspec.decoding.drafters.mtp import MTPDrafter
from dspec.decoding.engine import SpeculativeEngine
from dspec.hf_export import hf_config_dict, hf_state_dict
from dspec.models import formats
from dspec.models.config import TransformerConfig
from dspec.models.formats.mtp import load_mtp, save_speculators
from dspec.models.mtp import MTP, MTPConfig, save_mtp
from dspec.models.transformer import Transformer
from speculators_import import speculators_module

T = 12          # sequence length of the parity checks
PROMPTS = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [9, 8]]
NEW_TOKENS = 16


@jax.jit
def _dspec_logits(mtp, target, tokens_BS):
  """Every depth's logits [D, B, T, V'] over a full causal pass (h^0 post-norm)."""
  h0 = mtp.h0(target(tokens_BS, taps=mtp.cfg.taps(target.cfg)))
  return jnp.stack([mtp.logits(target, k, h) for k, h in enumerate(mtp(target, h0, tokens_BS),
                                                                   start=1)])


def _tokens(seed=0):
  return np.random.default_rng(seed).integers(0, TINY.vocab_size, (1, T)).astype(np.int32)


def _torch_state(tensors):
  import torch
  return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}


# ------------------------------------------------------------------ speculators form


def _speculators_model(spec, steps: int):
  """speculators' MTPDraftModel for the tiny target (eager attention)."""
  from speculators.config import SpeculatorsConfig, VerifierConfig
  from speculators.proposals.greedy import GreedyTokenProposalConfig
  from transformers import Qwen3Config
  layer = hf_config_dict(TINY, 'qwen3')
  layer.pop('torch_dtype')
  config = spec.MTPSpeculatorConfig(
      transformer_layer_config=Qwen3Config(**layer),
      speculators_config=SpeculatorsConfig(
          algorithm='mtp', default_proposal_method='greedy',
          proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=steps)],
          verifier=VerifierConfig(name_or_path=None, architectures=['Qwen3ForCausalLM'])))
  config.transformer_layer_config._attn_implementation = 'eager'
  return spec.MTPDraftModel(config)


def _speculators_logits(ref, target, tokens):
  """speculators' per-step logits [steps, 1, valid, V] with the target's embedding/head."""
  import torch
  with torch.no_grad():
    ref.embed_tokens.weight.copy_(torch.tensor(np.asarray(target.embed_tokens[...])))
    ref.lm_head.weight.copy_(torch.tensor(np.asarray(target.lm_head[...]).T))
    ref.eval()
    hidden = np.array(target(tokens).hidden_BTD)
    logits, _, _ = ref(torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(hidden))
  return np.stack([l.numpy() for l in logits])


def test_speculators_saved_mtp_matches_speculators(tiny_model, tmp_path):
  """A directory speculators' MTPDraftModel.save_pretrained wrote (random weights) loads
  as a shared-depth chained MTP whose 3 steps' logits equal speculators' forward."""
  import torch
  spec = speculators_module('models.mtp')
  torch.manual_seed(0)
  ref = _speculators_model(spec, steps=3)
  with torch.no_grad():
    for name, p in ref.mtp_layers.named_parameters():
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if 'norm' in name else 0.3 * torch.randn_like(p))
  ref.save_pretrained(str(tmp_path))
  assert 'mtp_layers.0.input_proj.weight' in load_file(tmp_path / 'model.safetensors')

  mtp = load_mtp(str(tmp_path), target_cfg=TINY)
  assert mtp.cfg == MTPConfig(num_depths=3, shared_depth=True)
  tokens = _tokens()
  expected = _speculators_logits(ref, tiny_model, tokens)
  valid = expected.shape[2]
  assert expected.shape[0] == 3 and valid == T - 4
  ours = np.asarray(_dspec_logits(mtp, tiny_model, tokens))[:, :, :valid]
  np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=1e-4)
  assert np.abs(expected[0] - expected[1]).max() > 1e-2   # the steps differ


def test_speculators_round_trip(tiny_model, tmp_path):
  """dspec -> speculators form -> dspec keeps every weight; speculators reads the same
  directory and gives the same logits."""
  spec = speculators_module('models.mtp')
  mtp = MTP(MTPConfig(num_depths=2, shared_depth=True), TINY, rngs=nnx.Rngs(4))
  mtp.depths[0].layer.mlp.down_proj.kernel[...] *= 10.0
  save_speculators(tmp_path, mtp)
  back = load_mtp(str(tmp_path), target_cfg=TINY)
  assert back.cfg == mtp.cfg
  for (name, a), b in zip(leaf_paths(nnx.to_pure_dict(nnx.state(mtp, nnx.Param))).items(),
                          leaf_paths(nnx.to_pure_dict(nnx.state(back, nnx.Param))).values()):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)

  config = spec.MTPSpeculatorConfig.from_pretrained(str(tmp_path))
  config.transformer_layer_config._attn_implementation = 'eager'
  ref = spec.MTPDraftModel(config)
  missing, unexpected = ref.load_state_dict(_torch_state(load_file(tmp_path /
                                                                   'model.safetensors')),
                                            strict=False)
  assert not unexpected and set(missing) == {'embed_tokens.weight', 'lm_head.weight',
                                             'verifier_lm_head.weight'}
  tokens = _tokens(1)
  expected = _speculators_logits(ref, tiny_model, tokens)
  ours = np.asarray(_dspec_logits(back, tiny_model, tokens))[:, :, :expected.shape[2]]
  np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=1e-4)

  with pytest.raises(ValueError, match='shared_depth=False has no speculators form'):
    save_speculators(tmp_path / 'x', MTP(MTPConfig(num_depths=2), TINY,
                                                     rngs=nnx.Rngs(0)))



@pytest.mark.multiprocess
@pytest.mark.slow
def test_export_drafter_writes_speculators_form(tmp_path):
  """scripts/export_drafter.py: a dspec MTP checkpoint (kind from its metadata) exports in
  speculators form with every weight kept; an MTP that form cannot express is one error
  line and leaves no output."""
  mtp = MTP(MTPConfig(num_depths=3, shared_depth=True), TINY, rngs=nnx.Rngs(5))
  save_mtp(tmp_path / 'ckpt', mtp)
  export = [sys.executable, os.path.join(REPO_ROOT, 'scripts', 'export_drafter.py')]
  proc = subprocess.run(export + [f'--path={tmp_path / "ckpt"}', f'--out={tmp_path / "out"}'],
                        capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert 'mtp drafter in speculators form, 3 depths' in proc.stdout
  back = load_mtp(str(tmp_path / 'out'), target_cfg=TINY)
  assert json.loads((tmp_path / 'out' / 'config.json').read_text())[
      'speculators_model_type'] == 'mtp' and back.cfg == mtp.cfg
  for (name, a), b in zip(leaf_paths(nnx.to_pure_dict(nnx.state(mtp, nnx.Param))).items(),
                          leaf_paths(nnx.to_pure_dict(nnx.state(back, nnx.Param))).values()):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)

  save_mtp(tmp_path / 'chained', MTP(MTPConfig(num_depths=2), TINY, rngs=nnx.Rngs(0)))
  proc = subprocess.run(export + [f'--path={tmp_path / "chained"}',
                                  f'--out={tmp_path / "out2"}'],
                        capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
  assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
      'error: mtp shared_depth=False has no speculators form (one shared Qwen3 layer, '
      "emb-first, post-norm, full vocabulary, the verifier's embedding and head)"]
  assert not (tmp_path / 'out2').exists()


# ----------------------------------------------------------------- DeepSeek-V3 layout


def write_deepseek_dir(path, target, depths=2, embedding='copy', head='copy', seed=0,
                       extra=None):
  """A HF checkpoint: the target's tensors plus `depths` MTP layers in DeepSeek-V3 layout
  (dense Qwen3 blocks, random). embedding / head: 'copy' of the main model's, 'absent',
  or 'own' (different values)."""
  rng = np.random.default_rng(seed)
  cfg = target.cfg
  d, hd, f, v = cfg.embed_dim, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size
  tensors = {k: np.asarray(x) for k, x in hf_state_dict(target).items()}
  shapes = {
      'enorm.weight': (d,), 'hnorm.weight': (d,), 'eh_proj.weight': (d, 2 * d),
      'input_layernorm.weight': (d,), 'post_attention_layernorm.weight': (d,),
      'self_attn.q_proj.weight': (cfg.num_heads * hd, d),
      'self_attn.k_proj.weight': (cfg.num_kv_heads * hd, d),
      'self_attn.v_proj.weight': (cfg.num_kv_heads * hd, d),
      'self_attn.o_proj.weight': (d, cfg.num_heads * hd),
      'self_attn.q_norm.weight': (hd,), 'self_attn.k_norm.weight': (hd,),
      'mlp.gate_proj.weight': (f, d), 'mlp.up_proj.weight': (f, d),
      'mlp.down_proj.weight': (d, f), 'shared_head.norm.weight': (d,)}
  for j in range(depths):
    prefix = f'model.layers.{cfg.num_layers + j}.'
    for name, shape in shapes.items():
      x = rng.normal(size=shape)
      x = 1.0 + 0.2 * x if 'norm' in name else (0.3 if 'mlp' in name else 0.2) * x
      tensors[prefix + name] = x.astype(np.float32)
    main_head = 'model.embed_tokens.weight' if cfg.tie_embeddings else 'lm_head.weight'
    for kind, name, main in ((embedding, 'embed_tokens.weight', 'model.embed_tokens.weight'),
                             (head, 'shared_head.head.weight', main_head)):
      if kind == 'copy':
        tensors[prefix + name] = tensors[main].copy()
      elif kind == 'own':
        tensors[prefix + name] = rng.normal(size=(v, d)).astype(np.float32)
  tensors.update(extra or {})
  config = dict(hf_config_dict(cfg, 'qwen3'), num_nextn_predict_layers=depths)
  os.makedirs(path, exist_ok=True)
  save_file(tensors, os.path.join(path, 'model.safetensors'))
  with open(os.path.join(path, 'config.json'), 'w') as fh:
    json.dump(config, fh)
  return str(path)


def deepseek_reference(path, target, tokens):
  """DeepSeek-V3's MTP in torch from the tensors by name: depth k at i:
  h'_k = eh_proj([enorm(emb(t_{i+k})) ; hnorm(h_{k-1})]) -> decoder block ->
  h_k = shared_head.norm(.) -> logits = shared_head.head(h_k) (the main model's embedding /
  head where the layer has none); h_0 = the target's post-norm hidden."""
  import torch
  from transformers import Qwen3Config
  from transformers.models.qwen3.modeling_qwen3 import (Qwen3DecoderLayer,
                                                        Qwen3RotaryEmbedding)
  tensors = {k: torch.from_numpy(v) for k, v in
             load_file(os.path.join(path, 'model.safetensors')).items()}
  config_dict = json.load(open(os.path.join(path, 'config.json')))
  config_dict.pop('torch_dtype')
  config = Qwen3Config(**config_dict)
  config._attn_implementation = 'eager'
  big_l, t = config.num_hidden_layers, tokens.shape[1]
  eps = config.rms_norm_eps

  def rms(x, w):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

  positions = torch.arange(t)[None]
  rope = Qwen3RotaryEmbedding(config)
  mask = torch.triu(torch.full((t, t), float('-inf')), 1)[None, None]
  ids = torch.from_numpy(tokens.astype(np.int64))
  h = torch.from_numpy(np.array(target(tokens).hidden_BTD))
  out = []
  with torch.no_grad():
    for k in range(1, config.num_nextn_predict_layers + 1):
      p = f'model.layers.{big_l + k - 1}.'
      emb = tensors.get(p + 'embed_tokens.weight', tensors['model.embed_tokens.weight'])
      head = tensors.get(p + 'shared_head.head.weight', tensors['lm_head.weight'])
      shifted = torch.nn.functional.pad(ids[:, k:], (0, k))
      x = torch.cat([rms(emb[shifted], tensors[p + 'enorm.weight']),
                     rms(h, tensors[p + 'hnorm.weight'])], -1) @ tensors[p + 'eh_proj.weight'].T
      block = Qwen3DecoderLayer(config, layer_idx=0)
      block.load_state_dict({n[len(p):]: v for n, v in tensors.items() if n.startswith(p)
                             and not n[len(p):].startswith(('enorm', 'hnorm', 'eh_proj',
                                                            'shared_head', 'embed_tokens'))})
      x = block(x, attention_mask=mask, position_ids=positions,
                position_embeddings=rope(x, positions))
      x = x[0] if isinstance(x, tuple) else x
      h = rms(x, tensors[p + 'shared_head.norm.weight'])
      out.append((h @ head.T).numpy())
  return np.stack(out)


@pytest.mark.parametrize('embedding,head,own', [
    ('copy', 'copy', (False, False)),      # DeepSeek-V3: copies of the main model's
    ('absent', 'own', (False, True)),      # no embedding copy; a head of its own
], ids=['shared', 'own_head'])
def test_deepseek_layout_matches_reference(tiny_model, tmp_path, embedding, head, own):
  path = write_deepseek_dir(tmp_path, tiny_model, embedding=embedding, head=head)
  assert formats.detect(path) == 'deepseek'
  mtp = load_mtp(path, target_cfg=TINY)
  assert (mtp.cfg.own_embedding, mtp.cfg.own_head) == own
  assert mtp.cfg.num_depths == 2 and mtp.cfg.chained and not mtp.cfg.shared_depth
  tokens = _tokens(2)
  ours = np.asarray(_dspec_logits(mtp, tiny_model, tokens))
  np.testing.assert_allclose(ours, deepseek_reference(path, tiny_model, tokens),
                             atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_deepseek_own_embedding_is_used(tiny_model, tmp_path):
  """Per-layer embeddings that differ from the main model's are the depths' own (the
  logits change when they are replaced by the main model's)."""
  path = write_deepseek_dir(tmp_path / 'own', tiny_model, depths=1, embedding='own')
  mtp = load_mtp(path, target_cfg=TINY)
  assert mtp.cfg.own_embedding and not mtp.cfg.own_head and mtp.cfg.shared_depth
  tokens = _tokens(3)
  ours = np.asarray(_dspec_logits(mtp, tiny_model, tokens))
  np.testing.assert_allclose(ours, deepseek_reference(path, tiny_model, tokens), atol=1e-4,
                             rtol=1e-4)
  shared = write_deepseek_dir(tmp_path / 'shared', tiny_model, depths=1, embedding='absent')
  assert np.abs(np.asarray(_dspec_logits(load_mtp(shared), tiny_model, tokens)) -
                ours).max() > 1e-2


@pytest.fixture(scope='module')
def deepseek_dir(tmp_path_factory, tiny_model):
  return write_deepseek_dir(tmp_path_factory.mktemp('deepseek'), tiny_model)


def test_target_loads_from_the_same_directory(tiny_model, deepseek_dir):
  target, cfg = hf_import.load_hf_model(deepseek_dir)
  assert cfg == TINY
  ours = leaf_paths(nnx.to_pure_dict(nnx.state(target, nnx.Param)))
  for name, x in leaf_paths(nnx.to_pure_dict(nnx.state(tiny_model, nnx.Param))).items():
    np.testing.assert_array_equal(np.asarray(ours[name]), np.asarray(x), err_msg=name)


@pytest.mark.slow
def test_greedy_deepseek_drafter_equals_ar(tiny_split, tiny_model, deepseek_dir):
  """Built by the registry from the HF directory; drafts with both depths."""
  engine = SpeculativeEngine(tiny_split[0])
  ar, _ = generate(engine, tiny_split[1], None, PROMPTS, NEW_TOKENS)
  cfg = ml_collections.ConfigDict({'drafter': 'mtp', 'drafters': {
      'mtp': dict(registry.DEFAULTS['mtp'], path=deepseek_dir)}})
  drafter, params = registry.build_drafter(cfg, tiny_model)
  assert isinstance(drafter, MTPDrafter) and drafter.num_draft == 2
  outs, state = generate(SpeculativeEngine(tiny_split[0], drafter=drafter), tiny_split[1],
                         params, PROMPTS, NEW_TOKENS)
  assert outs == ar
  assert int(np.asarray(state.stats.proposed_B).sum()) > 0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_cli_decodes_target_and_mtp_from_one_hf_dir(tmp_path):
  """The tiny preset (tied embeddings): the per-layer head copies equal the tied main
  embedding, so the drafter borrows the target's."""
  sys.path.insert(0, REPO_ROOT)
  from configs import common
  target = Transformer(TransformerConfig(**common.MODEL_PRESETS['tiny']), rngs=nnx.Rngs(0))
  deepseek_dir = write_deepseek_dir(tmp_path, target)
  assert not load_mtp(deepseek_dir).cfg.own_head
  out = subprocess.run(
      [sys.executable, 'scripts/decode.py', '--config=configs/mtp_demo.py:tiny',
       '--config.model.source=hf', f'--config.model.path={deepseek_dir}',
       f'--config.drafters.mtp.path={deepseek_dir}', '--config.compare_ar=True',
       '--prompt_ids=5,6,7,5,6'],
      cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert 'method=mtp' in out.stdout and 'lossless=True' in out.stdout, out.stdout


# ------------------------------------------------------------------------ bad input


def test_bad_checkpoints_give_one_line(tiny_model, tmp_path):
  file = str(tmp_path / '{}' / 'model.safetensors')
  mla = {'model.layers.2.self_attn.kv_a_proj_with_mqa.weight': np.zeros((8, 32), np.float32)}
  path = write_deepseek_dir(tmp_path / 'mla', tiny_model, extra=mla)
  with pytest.raises(ValueError) as e:
    load_mtp(path)
  assert str(e.value).startswith(file.format('mla')) and 'kv_a_proj_with_mqa' in str(e.value)
  assert 'MLA and MoE blocks are not supported' in str(e.value) and '\n' not in str(e.value)
  moe = {'model.layers.3.mlp.experts.0.up_proj.weight': np.zeros((8, 32), np.float32)}
  path = write_deepseek_dir(tmp_path / 'moe', tiny_model, extra=moe)
  with pytest.raises(ValueError, match=r"'model.layers.3.mlp.experts.0.up_proj.weight' "
                                       r'\(experts\)'):
    load_mtp(path)

  path = write_deepseek_dir(tmp_path / 'missing', tiny_model, depths=1)
  tensors = load_file(os.path.join(path, 'model.safetensors'))
  del tensors['model.layers.2.hnorm.weight']
  save_file(tensors, os.path.join(path, 'model.safetensors'))
  with pytest.raises(ValueError, match="tensor 'model.layers.2.hnorm.weight' is missing"):
    load_mtp(path)

  wide = TransformerConfig(**dict(TINY.to_dict(), embed_dim=48))
  path = write_deepseek_dir(tmp_path / 'ok', tiny_model, depths=1)
  with pytest.raises(ValueError, match='hidden size 32 does not match the target width 48'):
    load_mtp(path, target_cfg=wide)

  config_path = os.path.join(path, 'config.json')
  config = json.load(open(config_path))
  for key, value, message in [
      ('num_nextn_predict_layers', 5, "'num_nextn_predict_layers' must be in 1..4, got 5"),
      ('model_type', 'deepseek_v3', "model_type 'deepseek_v3' is not supported")]:
    json.dump(dict(config, **{key: value}), open(config_path, 'w'))
    with pytest.raises(ValueError, match=message) as e:
      load_mtp(path)
    assert str(e.value).startswith(config_path)
  json.dump({k: v for k, v in config.items() if k != 'num_nextn_predict_layers'},
            open(config_path, 'w'))
  with pytest.raises(ValueError, match='neither a speculators config'):
    load_mtp(path)

  spec_dir = tmp_path / 'spec'
  save_speculators(spec_dir, MTP(MTPConfig(shared_depth=True), TINY,
                                             rngs=nnx.Rngs(0)))
  config = json.load(open(spec_dir / 'config.json'))
  json.dump(dict(config, num_nextn_predict_layers=2), open(spec_dir / 'config.json', 'w'))
  with pytest.raises(ValueError, match="'num_nextn_predict_layers' must be 1"):
    load_mtp(str(spec_dir))
