"""Multi-device checks on 8 simulated CPU devices; prints one `RESULT {json}` line.

Run by `test_sharding.py` in subprocesses (XLA_FLAGS must be set before jax starts); the
two parts run side by side, each with one jax start-up:
  python tests/scale/mesh_checks.py --part=decode
  python tests/scale/mesh_checks.py --part=rest [--golden=PATH]   # PATH: write the specs
Compilation dominates: XLA's fast-compile flags (tests/xla_flags.py), the same for every mesh.
"""

import functools
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from xla_flags import with_fast_compile  # noqa: E402
os.environ['XLA_FLAGS'] = with_fast_compile(os.environ.get('XLA_FLAGS', '') +
                                            ' --xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import logging  # noqa: E402
from flax import nnx  # noqa: E402

from configs import common  # noqa: E402
from dspec import compiled_programs, sharding  # noqa: E402
from dspec.decoding.drafters.ngram import NgramDrafter  # noqa: E402
from dspec.decoding.drafters.oracle import OracleDrafter  # noqa: E402
from dspec.decoding.drafters.self_draft import SelfDrafter  # noqa: E402
from dspec.decoding.runner import speculative_engine  # noqa: E402
from dspec.decoding.tree_engine import TreeConfig  # noqa: E402
from dspec.models.config import TransformerConfig  # noqa: E402
from dspec.models.transformer import Transformer  # noqa: E402
from dspec.training import target_lm, trainer  # noqa: E402

# 8 heads and 4 kv heads: tensor=4 shards kv heads, tensor=8 replicates them.
MODEL = TransformerConfig(vocab_size=64, num_layers=1, embed_dim=32, num_heads=8,
                          num_kv_heads=4, head_dim=8, mlp_dim=64, qk_norm=True)
MESHES = ('', 'data=8', 'data=2,tensor=4', 'tensor=8')
TREE_MESH = 'data=2,tensor=4'   # token trees on a 2-D mesh
GOLDEN_MESH = 'fsdp=2,tensor=4'
TRAIN_MESHES = ('', 'fsdp=2,tensor=4', 'data=2,fsdp=2,tensor=2')
PROMPTS = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [9, 9, 1], [7, 20, 31, 7, 20, 31, 7, 44, 2],
           [1, 2, 3, 1, 2, 3, 1], [50, 51], [8, 8, 8, 8], [11, 12, 13, 14, 11, 12], [60]]
NEW_TOKENS = 10


def target_ctor():
  model = Transformer(MODEL, rngs=nnx.Rngs(0))
  model.lm_head[...] = model.lm_head[...] * 20.0   # no argmax near-ties
  return model


def create(ctor, placement):
  """The module, params created by one jitted init: sharded on a mesh, else on 1 device."""
  if placement is not None:
    return placement.create_module(ctor)
  graphdef, _ = nnx.split(nnx.eval_shape(ctor))
  return nnx.merge(graphdef, jax.jit(lambda: nnx.split(ctor())[1])())


def optional_drafters():
  """name -> (module ctor, engine-drafter factory), or name -> reason it is skipped."""
  out = {}
  try:
    from dspec.decoding.drafters.mtp import MTPDrafter
    from dspec.models.mtp import MTP, MTPConfig
    out['mtp'] = (lambda: MTP(MTPConfig(num_depths=2), MODEL, rngs=nnx.Rngs(1)),
                  lambda m: MTPDrafter.from_model(m))
  except ImportError as e:
    out['mtp'] = f'MTP modules not importable: {e}'
  try:
    from dspec.decoding.drafters import dflash as dflash_drafters
    from dspec.models.dflash import DFlashConfig, DFlashModel
    cfg = DFlashConfig.create(MODEL.num_layers, 1, 4, mask_token_id=1)
    out['dflash'] = (lambda: DFlashModel(cfg, MODEL, rngs=nnx.Rngs(2)),
                     lambda m: dflash_drafters.DFlashDrafter.create(m))
  except ImportError as e:
    out['dflash'] = f'DFlash modules not importable: {e}'
  return out


def decode_checks(result, meshes):
  prompt_BP = np.zeros((len(PROMPTS), max(map(len, PROMPTS))), np.int32)
  for i, p in enumerate(PROMPTS):
    prompt_BP[i, :len(p)] = p
  lens_B = np.array([len(p) for p in PROMPTS], np.int32)
  optional = optional_drafters()
  result['skipped'] = {k: v for k, v in optional.items() if isinstance(v, str)}
  outputs, timings, equal = {}, {}, {}
  one_device = nnx.split(create(target_ctor, None))[1]
  for mesh in meshes:
    placement = sharding.Placement.create(mesh, model_cfg=MODEL) if mesh else None
    graphdef, params = nnx.split(create(target_ctor, placement))
    equal[mesh or '1'] = all(bool(jnp.array_equal(a, b)) for a, b in zip(
        jax.tree.leaves(one_device), jax.tree.leaves(params)))
    def run(drafter, dparams, verify_length='fixed'):
      engine = speculative_engine(graphdef, drafter, verify_length=verify_length,
                                  placement=placement, tree=TreeConfig(num_nodes=8, top_k=2))
      state = engine.prefill(params, dparams, prompt_BP, lens_B, max_new_tokens=NEW_TOKENS)
      state = engine.generate(params, dparams, state)
      tokens, nums = jax.device_get((state.tokens_BL, state.num_tokens_B))
      outs = [tokens[b, lens_B[b]:nums[b]].tolist() for b in range(len(PROMPTS))]
      return outs, state

    t0 = time.perf_counter()
    if placement is None:   # one device: AR, the reference of every drafter on every mesh
      outputs.setdefault('ar', {})['1'] = run(None, None)[0]
      timings['1'] = round(time.perf_counter() - t0, 2)
      continue
    ar, ar_state = run(None, None)
    runs = {'ar': ar}
    reference = placement.put_params(ar_state.tokens_BL)
    runs['ngram'] = run(NgramDrafter(num_draft=3, max_n=3), None)[0]
    runs['oracle'] = run(OracleDrafter(num_draft=3, acceptance=(0.9, 0.5)), reference)[0]
    runs['self'], self_state = run(SelfDrafter(num_draft=2), None)
    if mesh == 'data=2,tensor=4':
      result['state_specs'] = {
          k: v for k, v in sharding.spec_summary(placement.state_specs(self_state)).items()
          if k in ('cache/k_LBSKD', 'tokens_BL', 'drafter_state/k_LBSKD', 'step')}
    for name, entry in optional.items():
      if isinstance(entry, str):
        continue
      ctor, factory = entry
      drafter, dparams = factory(create(ctor, placement))
      runs[name] = run(drafter, dparams)[0]
      if name == 'mtp' and mesh == TREE_MESH:   # EAGLE-2 trees of the MTP heads
        runs['mtp_tree'] = run(drafter, dparams, 'tree')[0]
    if mesh == TREE_MESH:   # n-gram tries
      runs['ngram_tree'] = run(NgramDrafter(num_draft=3, max_n=3), None, 'tree')[0]
    for name, outs in runs.items():
      outputs.setdefault(name, {})[mesh or '1'] = outs
    timings[mesh or '1'] = round(time.perf_counter() - t0, 2)
  result['decode'] = outputs
  result['decode_seconds'] = timings
  result['created_sharded_equal'] = equal


def runner_check(result):
  from dspec.decoding import runner
  cfg = common.decode_config('tiny')
  cfg.batch_size, cfg.max_new_tokens, cfg.timing_repeats = 4, 8, 1
  cfg.drafter, cfg.compare_ar, cfg.mesh = 'ngram', True, 'data=4,tensor=2'
  prompts = [[1, 2, 3, 1, 2, 3], [5, 6, 7], [9, 9, 9, 9], [4, 5]]
  report = runner.run_decode(cfg, prompts)
  with compiled_programs.counting_compiles() as compiled:   # a second call, same buckets
    again = runner.run_decode(cfg, prompts[::-1])
  result['runner'] = {'lossless': report['lossless'], 'output_ids': report['output_ids'],
                      'again_lossless': again['lossless'],
                      'again_engine_compiles': [n for n in compiled if n.endswith('_fn)')]}


def structured_check(result):
  """Structured output (a regex) on the demo target: MTP fixed and MTP trees on
  data=4,tensor=2 (its 2 kv heads on the tensor axis) against constrained AR on one device."""
  from configs import demo
  from dspec import loading
  from dspec.decoding import runner
  from dspec.decoding.drafters import registry
  from dspec.structured import Constraint
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  cfg = demo.get_config('small')
  cfg.model.path = os.path.join(root, cfg.model.path)
  cfg.drafters.mtp.path = os.path.join(root, cfg.drafters.mtp.path)
  cfg.max_new_tokens, cfg.timing_repeats = 16, 0
  prompts = ['Question: Is the sky blue? Answer:', 'def add(a, b):']
  regex = Constraint.of(regex=r'(Yes|No)\. [A-Za-z ,]{1,30}\.')
  settings = runner.Settings.from_config(cfg)
  out = {}
  for mesh, name, verify_length in (('', 'none', 'fixed'), ('data=4,tensor=2', 'mtp', 'fixed'),
                                    ('data=4,tensor=2', 'mtp', 'tree')):
    placement = sharding.Placement.create(mesh) if mesh else None
    model, tokenizer, max_seq_len = loading.build_target(cfg.model, placement)
    placement = placement and placement.for_model(model.cfg)
    cfg.drafter = name
    drafter, dparams = registry.build_drafter(cfg, model)
    report = runner.decode(runner.Target(model, tokenizer, max_seq_len), prompts, drafter,
                           dparams, settings=settings, verify_length=verify_length,
                           placement=placement, constraints=regex,
                           tree=TreeConfig(num_nodes=8, top_k=2))
    out[f'{name}:{verify_length}:{mesh or "1"}'] = report['ids']
  result['structured'] = out


def _train_task(name):
  """A fresh TrainTask on fixed random tokens (same init and batches for every mesh)."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, MODEL.vocab_size, size=(8, 17)).astype(np.int32)
  if name == 'target':
    return trainer.TrainTask(model=Transformer(MODEL, rngs=nnx.Rngs(0)), frozen=None,
                             loss_fn=target_lm.lm_loss,
                             get_batch=lambda step: {'tokens': tokens})
  if name == 'mtp':
    from dspec.models.mtp import MTP, MTPConfig
    from dspec.training import mtp_task
    model = mtp_task.JointModel(Transformer(MODEL, rngs=nnx.Rngs(0)),
                                MTP(MTPConfig(num_depths=2), MODEL, rngs=nnx.Rngs(1)))
    return trainer.TrainTask(
        model=model, frozen=None,
        loss_fn=functools.partial(mtp_task.joint_loss,
                                  weights=mtp_task.depth_weights(2, 1.0)),
        get_batch=lambda step: {'tokens': tokens, 'mtp_lambda': np.float32(0.3)})
  from dspec.models.dflash import DFlashConfig, DFlashModel
  from dspec.training import dflash_task
  cfg = DFlashConfig.create(MODEL.num_layers, 1, 4, mask_token_id=1)
  return trainer.TrainTask(
      model=DFlashModel(cfg, MODEL, rngs=nnx.Rngs(2)),
      frozen=Transformer(MODEL, rngs=nnx.Rngs(0)),
      loss_fn=functools.partial(dflash_task.dflash_loss, num_anchors=2, gamma=4.0),
      get_batch=lambda step: {'tokens': tokens, 'loss_mask': np.ones_like(tokens, bool)})


def train_checks(result):
  losses, skipped = {}, {}
  for name in ('target', 'mtp', 'dflash'):
    for mesh in TRAIN_MESHES if name == 'target' else TRAIN_MESHES[:2]:
      try:
        task = _train_task(name)
      except ImportError as e:
        skipped[name] = f'{name} training modules not importable: {e}'
        break
      cfg = common.training_config(name)
      cfg.update(num_steps=2, log_every=1, eval_every=1000, ckpt_every=1000, mesh=mesh,
                 learning_rate=1e-2)
      with tempfile.TemporaryDirectory() as workdir:
        out = trainer.train(task, cfg, workdir)
      losses.setdefault(name, {})[mesh or '1'] = out['last']['loss']
  result['train'] = losses
  result['train_skipped'] = skipped


def spec_checks(result, golden_path=None):
  placement = sharding.Placement.create(GOLDEN_MESH, model_cfg=MODEL)
  abstract = nnx.split(nnx.eval_shape(target_ctor))[1]
  specs = sharding.spec_summary(placement.param_specs(abstract))
  result['param_specs'] = specs
  if golden_path:
    with open(golden_path, 'w') as f:
      json.dump({'mesh': GOLDEN_MESH, 'model': MODEL.to_dict(), 'param_specs': specs}, f,
                indent=1, sort_keys=True)
      f.write('\n')
  errors = {}
  small = TransformerConfig(vocab_size=64, num_layers=1, embed_dim=32, num_heads=4,
                            num_kv_heads=2, head_dim=8, mlp_dim=64)
  for key, call in {
      'heads': lambda: sharding.Placement.create('tensor=8', model_cfg=small),
      'mesh_size': lambda: sharding.make_mesh('data=3'),
      'axis_name': lambda: sharding.make_mesh('model=8'),
      'batch': lambda: speculative_engine(
          nnx.split(nnx.eval_shape(target_ctor))[0],
          placement=sharding.Placement.create('data=8')).prefill(
              None, None, np.ones((3, 2), np.int32), np.full((3,), 2, np.int32),
              max_new_tokens=2)}.items():
    try:
      call()
      errors[key] = None
    except ValueError as e:
      errors[key] = str(e)
  result['errors'] = errors
  result['kv_rule_tensor8'] = dict(sharding.Placement.create(
      'tensor=8', model_cfg=MODEL).rules)['kv_heads']


def kernel_check(result):
  from pallas_kernels.block_attention import CausalMask, block_attention
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (4, 16, 8, 8))
  k = jax.random.normal(keys[1], (4, 16, 4, 8))
  v = jax.random.normal(keys[2], (4, 16, 4, 8))
  fn = jax.jit(lambda q, k, v: block_attention(q, k, v, CausalMask(),
                                               implementation='interpret'))
  plain = fn(q, k, v)
  placement = sharding.Placement.create('data=2,tensor=4')
  with placement.context():
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: block_attention(
        q, k, v, CausalMask(), implementation='interpret'))(q, k, v))
    sharded = jax.jit(lambda q, k, v: block_attention(
        q, k, v, CausalMask(), implementation='interpret'))(q, k, v)
  result['kernel'] = {'max_abs_diff': float(jnp.max(jnp.abs(plain - sharded))),
                      'shard_map': 'shard_map' in jaxpr}


def main(argv):
  logging.set_verbosity(logging.ERROR)
  flags = dict(a.lstrip('-').split('=', 1) for a in argv)
  parts = {   # about equal compile work on each side
      'decode': (('decode', lambda r: decode_checks(r, MESHES)), ('runner', runner_check)),
      'rest': (('specs', lambda r: spec_checks(r, flags.get('golden'))),
               ('kernel', kernel_check), ('train', train_checks),
               ('structured', structured_check)),
  }
  result = {'devices': jax.device_count()}
  seconds = {}
  for name, check in parts[flags.get('part', 'decode')]:
    t0 = time.perf_counter()
    check(result)
    seconds[name] = round(time.perf_counter() - t0, 2)
  result['seconds'] = seconds
  print('RESULT ' + json.dumps(result))


if __name__ == '__main__':
  main(sys.argv[1:])
