"""HF import/export: logits and greedy tokens match `transformers` on tiny random models."""

import functools
import json
import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip('torch', reason="parity tests need torch: pip install -e '.[test]'")
transformers = pytest.importorskip(
    'transformers', reason="parity tests need transformers: pip install -e '.[test]'")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from dspec.loading import load_target_checkpoint as load_target  # noqa: E402
from dspec.decoding.engine import SpeculativeEngine  # noqa: E402
from dspec.hf_export import export_to_hf, to_transformers_model  # noqa: E402
from dspec.hf_import import load_hf_model  # noqa: E402
from dspec.models.formats.hf_config import config_from_hf  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
TOKENS = np.random.RandomState(0).randint(0, 128, size=(2, 16))


def _make_hf_dir(root, model_type):
  """A random tiny HF model saved with save_pretrained; Qwen3 tied + sharded, Llama untied."""
  torch.manual_seed(0)
  if model_type == 'qwen3':
    config = transformers.Qwen3Config(tie_word_embeddings=True, **COMMON)
    model = transformers.Qwen3ForCausalLM(config)
    shard = '40KB'  # -> several model-0000k-of-0000n.safetensors + index
  else:
    config = transformers.LlamaConfig(tie_word_embeddings=False, rope_theta=5e5, **COMMON)
    model = transformers.LlamaForCausalLM(config)
    shard = '50MB'  # -> one model.safetensors
  out = os.path.join(root, model_type)
  model.save_pretrained(out, max_shard_size=shard)
  return out, model.float().eval()


@pytest.fixture(scope='module')
def qwen3(tmp_path_factory):
  return _make_hf_dir(str(tmp_path_factory.mktemp('hf')), 'qwen3')


@pytest.fixture(scope='module')
def llama(tmp_path_factory):
  return _make_hf_dir(str(tmp_path_factory.mktemp('hf')), 'llama')


@pytest.fixture(params=['qwen3', 'llama'])
def hf(request):
  """(hf_dir, torch model) of each family."""
  return request.getfixturevalue(request.param)


def _torch_logits(hf_model, tokens):
  with torch.no_grad():
    return hf_model(torch.as_tensor(tokens)).logits.numpy()


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, params, tokens):
  return nnx.merge(graphdef, params)(tokens).logits_BTV


def _dspec_logits(model, tokens):
  graphdef, params = nnx.split(model)
  return np.asarray(_forward(graphdef, params, jnp.asarray(tokens)))


def test_layout_of_saved_models(hf):
  hf_dir, _ = hf
  sharded = os.path.exists(os.path.join(hf_dir, 'model.safetensors.index.json'))
  assert sharded == hf_dir.endswith('qwen3')


def test_logits_match_transformers(hf):
  hf_dir, hf_model = hf
  model, cfg = load_hf_model(hf_dir)
  assert cfg.qk_norm == hf_dir.endswith('qwen3') == cfg.tie_embeddings
  ref = _torch_logits(hf_model, TOKENS)
  np.testing.assert_allclose(_dspec_logits(model, TOKENS), ref, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_greedy_generation_matches_transformers(hf):
  hf_dir, hf_model = hf
  model, _ = load_hf_model(hf_dir)
  prompt = TOKENS[:1, :7]
  with torch.no_grad():
    ref = hf_model.generate(torch.as_tensor(prompt), do_sample=False, max_new_tokens=32,
                            min_new_tokens=32, eos_token_id=None, pad_token_id=0)
  ref_new = ref[0, prompt.shape[1]:].numpy()
  assert len(ref_new) == 32

  graphdef, params = nnx.split(model)
  engine = SpeculativeEngine(graphdef)
  state = engine.prefill(params, None, jnp.asarray(prompt, jnp.int32),
                         jnp.asarray([prompt.shape[1]], jnp.int32), max_new_tokens=32)
  state = engine.generate(params, None, state)
  p = prompt.shape[1]
  assert int(state.num_tokens_B[0]) == p + 32
  np.testing.assert_array_equal(np.asarray(state.tokens_BL[0, p:p + 32]), ref_new)


def test_export_import_round_trip_and_transformers_model(hf, tmp_path):
  hf_dir, _ = hf
  model, cfg = load_hf_model(hf_dir)
  export_to_hf(model, tmp_path / 'exported')
  tensors = load_file(str(tmp_path / 'exported' / 'model.safetensors'))
  assert ('lm_head.weight' in tensors) == (not cfg.tie_embeddings)
  reloaded, reloaded_cfg = load_hf_model(tmp_path / 'exported')
  assert reloaded_cfg == cfg
  ours = _dspec_logits(model, TOKENS)
  np.testing.assert_array_equal(_dspec_logits(reloaded, TOKENS), ours)
  peer = to_transformers_model(model)
  assert type(peer).__name__ == ('Qwen3ForCausalLM' if cfg.qk_norm else 'LlamaForCausalLM')
  assert not peer.training
  np.testing.assert_allclose(_torch_logits(peer, TOKENS), ours, atol=1e-4, rtol=0)
  from_disk = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'exported')
  np.testing.assert_allclose(_torch_logits(from_disk.float().eval(), TOKENS), ours,
                             atol=1e-4, rtol=0)


def _run_convert(*args):
  return subprocess.run([sys.executable, os.path.join(ROOT, 'scripts', 'convert_hf.py'), *args],
                        capture_output=True, text=True, timeout=120)


@pytest.mark.multiprocess
def test_convert_script_end_to_end(qwen3, tmp_path):
  hf_dir, hf_model = qwen3
  tokenizer_json = {'version': '1.0', 'model': {'type': 'WordLevel', 'vocab': {'a': 0}}}
  with open(os.path.join(hf_dir, 'tokenizer.json'), 'w') as f:
    json.dump(tokenizer_json, f)
  out = str(tmp_path / 'ckpt')
  result = _run_convert(f'--hf_dir={hf_dir}', f'--out={out}')
  assert result.returncode == 0, result.stderr
  with open(os.path.join(out, 'tokenizer.json')) as f:
    assert json.load(f) == tokenizer_json
  model, metadata = load_target(out)
  assert metadata['extra']['hf_model_type'] == 'qwen3'
  np.testing.assert_allclose(_dspec_logits(model, TOKENS), _torch_logits(hf_model, TOKENS),
                             atol=1e-4, rtol=0)


@pytest.mark.multiprocess
def test_convert_script_bad_input_is_one_error_line(tmp_path):
  result = _run_convert(f'--hf_dir={tmp_path / "missing"}', f'--out={tmp_path / "out"}')
  assert result.returncode == 1
  assert 'Traceback' not in result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: ') and 'missing' in lines[0]
  assert not os.path.exists(tmp_path / 'out')


def _llama_config(**overrides):
  config = {'model_type': 'llama', 'vocab_size': 32, 'hidden_size': 16,
            'intermediate_size': 32, 'num_hidden_layers': 1, 'num_attention_heads': 2}
  return {**config, **overrides}


def test_config_from_hf_defaults_and_rope_formats():
  cfg = config_from_hf(_llama_config(rope_theta=5e5))  # transformers 4 style
  assert (cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta) == (2, 8, 5e5)
  assert not cfg.qk_norm and not cfg.tie_embeddings
  cfg = config_from_hf(_llama_config(
      rope_parameters={'rope_type': 'default', 'rope_theta': 1e6}))  # transformers 5
  assert cfg.rope_theta == 1e6


@pytest.mark.parametrize('overrides, message', [
    ({'model_type': 'gpt2'}, "'gpt2' is not supported; supported: llama, qwen3"),
    ({'attention_bias': True}, 'biases'),
    ({'rope_scaling': {'rope_type': 'llama3', 'factor': 8.0}}, "'llama3' is not supported"),
    ({'rope_parameters': {'rope_type': 'yarn', 'rope_theta': 1e4}}, "'yarn'"),
    ({'hidden_act': 'gelu'}, 'gelu'),
])
def test_config_from_hf_rejects_unsupported(overrides, message):
  with pytest.raises(ValueError, match=message):
    config_from_hf(_llama_config(**overrides))


def test_missing_and_misshaped_tensors_are_named(llama, tmp_path):
  hf_dir = shutil.copytree(llama[0], tmp_path / 'llama')
  weights_path = os.path.join(hf_dir, 'model.safetensors')
  tensors = load_file(weights_path)
  name = 'model.layers.1.mlp.up_proj.weight'
  save_file({k: v for k, v in tensors.items() if k != name}, weights_path,
            metadata={'format': 'pt'})
  with pytest.raises(ValueError, match=f"tensor '{name}' is missing"):
    load_hf_model(hf_dir)
  save_file({**tensors, name: tensors[name][:, :5]}, weights_path, metadata={'format': 'pt'})
  with pytest.raises(ValueError, match=rf"'{name}' has shape \(128, 5\), expected \(128, 64\)"):
    load_hf_model(hf_dir)
  save_file({**tensors, 'model.layers.2.mlp.up_proj.weight': tensors[name]}, weights_path,
            metadata={'format': 'pt'})
  with pytest.raises(ValueError, match="unexpected tensor 'model.layers.2.mlp.up_proj.weight'"):
    load_hf_model(hf_dir)
