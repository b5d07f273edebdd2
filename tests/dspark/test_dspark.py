"""DSpark drafter: training through the registered 'dspark' task (loss terms, calibration
stored with the checkpoint, ECE), greedy losslessness at batch 1 and in a ragged batch
whose rows verify different lengths, the verify-length rule, and the registry path.

One toy target (tiny shape, 256-token vocab) and one drafter trained on the target's own
greedy continuation of PROMPT, in the self-distilled data format.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import TINY, generate
from configs import dspark_demo
from dspec import checkpoint
from dspec.decoding.controller import ControllerConfig, CostTable, VerifyLengthController
from dspec.decoding.drafters import registry
from dspec.decoding.drafters.dspark import verify_lengths
from dspec.decoding.engine import SpeculativeEngine
from dspec.decoding.prompts import generated_ids, pad_prompts
from dspec.decoding.runner import trace_of
from dspec.models.transformer import Transformer
from dspec.training import dspark_task, tasks

TOY = dataclasses.replace(TINY, vocab_size=256)
PROMPT = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
OTHER = [9, 9, 1]
NEW_TOKENS = 32
BLOCK = 4


@pytest.fixture(scope='module')
def toy(tmp_path_factory):
  """Toy target saved as a checkpoint, its greedy continuation, and a trained drafter."""
  root = tmp_path_factory.mktemp('dspark')
  target = Transformer(TOY, rngs=nnx.Rngs(0))
  target.lm_head[...] = target.lm_head[...] * 20.0   # varied, tie-free greedy outputs
  graphdef, params = nnx.split(target)
  ar = generate(SpeculativeEngine(graphdef), params, None, [PROMPT, OTHER], NEW_TOKENS)[0]
  target_dir = str(root / 'target')
  checkpoint.save_model(target_dir, target, kind='target', config=TOY.to_dict())

  data_dir = root / 'data'
  data_dir.mkdir()
  seq = np.array([PROMPT + ar[0]] * 2, np.int32)
  np.savez(data_dir / 'shard_00000.npz', tokens=seq,
           loss_mask=np.arange(seq.shape[1])[None].repeat(2, 0) >= len(PROMPT),
           lengths=np.array([seq.shape[1]] * 2, np.int32))
  (data_dir / 'manifest.json').write_text(json.dumps({'shards': ['shard_00000.npz'],
                                                      'complete': True}))
  cfg = dspark_demo.get_config(f'tiny,block={BLOCK},head=gated')
  cfg.model.source, cfg.model.path = 'checkpoint', target_dir
  cfg.data.path, cfg.data.heldout_fraction = str(data_dir), 0.5
  cfg.dspark.num_anchors = 16
  cfg.training.update(num_steps=60, batch_size=2, seq_len=seq.shape[1], learning_rate=1e-2,
                      log_every=60, eval_every=60, ckpt_every=60)
  result = tasks.run_training(cfg, str(root / 'run'))
  cfg.drafters.dspark.path = str(root / 'run' / 'final')
  cfg.drafters.dspark.num_draft = 0
  drafter, dparams = registry.build_drafter(cfg, target)
  return dict(target=target, graphdef=graphdef, params=params, ar=ar, cfg=cfg,
              drafter=drafter, dparams=dparams, result=result)


@pytest.mark.slow
def test_training_learns_the_sequence_and_stores_the_calibration(toy):
  ev = toy['result']['eval']
  assert ev['acc1'] > 0.95 and ev['tau_est'] > 3.0, ev
  assert ev['alpha'] > 0.5 and ev['conf_mae'] < 0.5, ev
  assert 0.0 <= ev['ece'] <= 1.0 and 0.0 <= ev['ece_raw'] <= 1.0
  print(f"held-out ECE of the prefix survival: sampled raw {ev['ece_raw']:.3f}, calibrated "
        f"{ev['ece']:.3f}; greedy raw {ev['greedy_ece_raw']:.3f}, calibrated "
        f"{ev['greedy_ece']:.3f}")
  meta = checkpoint.read_model_metadata(toy['cfg'].drafters.dspark.path, 'dspark')
  temps = meta['config']['dspark']['confidence_temperatures']
  assert len(temps) == BLOCK and all(t > 0 for t in temps)
  greedy_temps = meta['config']['dspark']['greedy_confidence_temperatures']
  assert len(greedy_temps) == BLOCK and all(t > 0 for t in greedy_temps)
  calibration = meta['extra']['calibration']
  assert calibration['sampled']['temperatures'] == temps
  assert calibration['greedy']['temperatures'] == greedy_temps
  assert toy['drafter'].config.confidence_temperatures == tuple(temps)
  assert 0.0 <= ev['greedy_ece'] <= 1.0
  assert toy['drafter'].num_draft == BLOCK and registry.name_of(toy['drafter']) == 'dspark'


def test_calibration_fits_a_miscalibrated_head():
  """Sequential temperature scaling recovers survival from over-confident logits."""
  rng = np.random.default_rng(0)
  true_z = rng.normal(1.0, 1.5, (4000, 3))
  alpha = 1.0 / (1.0 + np.exp(-true_z))
  valid = np.ones_like(alpha, bool)
  report = dspark_task.calibration_report(3.0 * true_z, alpha, valid)
  assert report['ece'] < 0.02 < report['ece_raw']
  np.testing.assert_allclose(report['temperatures'], 3.0, rtol=0.1)


def _ragged_start(toy, drafter):
  """(engine, jitted propose, state prefilled with [PROMPT, OTHER]) for `drafter`."""
  engine = SpeculativeEngine(toy['graphdef'], drafter=drafter)
  target = toy['target']
  propose = jax.jit(lambda dp, st: drafter.propose(dp, st.drafter_state, target,
                                                   engine.context(st), jax.random.key(0)))
  prompt_BP, lens = pad_prompts([PROMPT, OTHER])
  state = engine.prefill(toy['params'], toy['dparams'], prompt_BP, lens,
                         max_new_tokens=NEW_TOKENS)
  return engine, propose, state


@pytest.mark.slow
def test_greedy_equals_ar_in_a_ragged_batch_with_differing_verify_lengths(toy):
  drafter = dataclasses.replace(toy['drafter'], verify_cost=0.15)
  params, dparams = toy['params'], toy['dparams']
  engine, propose, state = _ragged_start(toy, drafter)
  lengths = []
  while not bool(np.all(state.done_B)):
    live = ~np.asarray(state.done_B)
    lengths.append(np.where(live, np.asarray(propose(dparams, state).num_proposed_B), -1))
    state = engine.run(params, dparams, state, 1)
  assert generated_ids(state) == toy['ar']
  assert int(state.stats.accepted_B[0]) >= 0.6 * NEW_TOKENS   # trained on row 0's output
  lengths = np.array(lengths)
  both = np.all(lengths >= 0, axis=1)
  assert np.any(lengths[both, 0] != lengths[both, 1]), lengths   # rows differ in a step
  assert len(np.unique(lengths[lengths >= 0])) >= 2
  # Batch 1, and a smaller block with a batch token budget.
  outs, _ = generate(engine, params, dparams, [PROMPT], NEW_TOKENS)
  assert outs[0] == toy['ar'][0]
  small = dataclasses.replace(toy['drafter'], num_draft=2, verify_budget=3)
  outs, _ = generate(SpeculativeEngine(toy['graphdef'], drafter=small), params, dparams,
                     [OTHER, PROMPT], NEW_TOKENS)
  assert outs == toy['ar'][::-1]


def test_verify_lengths_maximise_tokens_per_cost_under_a_budget():
  s = jnp.array([[0.9, 0.81, 0.73, 0.1], [0.5, 0.1, 0.05, 0.01], [0.99, 0.98, 0.97, 0.96]])
  limit = jnp.array([4, 4, 2])
  assert verify_lengths(s, limit, 0.0).tolist() == [4, 4, 2]
  # λ = 0.2: row 0 stops before its 0.1 slot, row 1 takes one, row 2 hits its limit.
  assert verify_lengths(s, limit, 0.2).tolist() == [3, 1, 2]
  assert verify_lengths(s, limit, 5.0).tolist() == [0, 0, 0]
  # Budget 4 over the batch: the four best (row, slot) pairs, a prefix of every row.
  assert verify_lengths(s, limit, 0.2, verify_budget=4).tolist() == [2, 0, 2]


def _table(batch, lam, c0=1e-3, propose=2e-4):
  """A step-cost table cost(batch, γ) = c0·(1 + λ·γ) over tiers 0 and BLOCK (tier 0 without
  the draft pass, which `propose` costs)."""
  return CostTable({(batch, 0): c0 - propose, (batch, BLOCK): c0 * (1 + lam * BLOCK)},
                   {batch: propose})


def test_cost_table_fits_the_load_aware_verify_cost():
  costs = {(8, g): 2e-3 * (1 + 0.4 * g) for g in (1, 3, 7)}
  costs[8, 0] = 2e-3 - 5e-4
  table = CostTable(costs, {8: 5e-4})
  np.testing.assert_allclose(table.verify_cost(8, (0, 1, 3, 7)), 0.4, rtol=1e-6)
  np.testing.assert_allclose(_table(2, 3.0).verify_cost(2, (0, BLOCK)), 3.0, rtol=1e-6)
  assert CostTable({(1, 0): 2.0, (1, 3): 1.0}, {1: 0.0}).verify_cost(1, (0, 3)) == 0.0


@pytest.mark.slow
def test_load_aware_verify_cost_sets_the_verify_lengths_without_recompiling(toy):
  """λ from a table where verify is nearly free: every row verifies its whole block; from
  one where it is expensive: rows verify fewer. One compiled proposal serves both."""
  drafter, dparams = toy['drafter'], toy['dparams']
  _, propose, state = _ragged_start(toy, drafter)
  assert float(state.drafter_state.verify_cost) == pytest.approx(drafter.verify_cost)
  lengths = {}
  for lam in (1e-4, 1.0):
    lam_b = _table(2, lam).verify_cost(2, (0, BLOCK))
    st = state.replace(drafter_state=drafter.set_verify_cost(state.drafter_state, lam_b))
    lengths[lam] = np.asarray(propose(dparams, st).num_proposed_B)
  assert lengths[1e-4].tolist() == [BLOCK, BLOCK]
  assert np.all(lengths[1.0] <= BLOCK) and lengths[1.0].sum() < 2 * BLOCK, lengths
  assert propose._cache_size() == 1


@pytest.mark.slow
def test_controller_hands_the_drafter_its_load_aware_verify_cost(toy):
  """Under verify_length=auto the controller sets λ(B) from its table; greedy output still
  equals AR in the ragged batch, and with nearly free verification (λ ≈ 0) row 0's
  proposals at tier BLOCK are whole blocks (cut to its remaining budget, the engine's
  shrinking verify size)."""
  params, dparams = toy['params'], toy['dparams']
  prompt_BP, lens = pad_prompts([PROMPT, OTHER])
  controller = VerifyLengthController(toy['graphdef'], toy['drafter'],
                                      config=ControllerConfig(tiers=(0, BLOCK)), trace=True)
  for lam in (1e-4, 0.5):
    controller.costs = _table(2, lam)
    state = controller.prefill(params, dparams, prompt_BP, lens, max_new_tokens=NEW_TOKENS)
    state = controller.generate(params, dparams, state)
    assert generated_ids(state) == toy['ar']
    assert float(state.drafter_state.verify_cost) == pytest.approx(lam, rel=1e-5)
    if lam < 1e-3:
      steps = trace_of(state, controller.row0_tiers)['steps']
      generated, proposed = 1, []           # the prefill commits row 0's first token
      for step in steps:
        if step['tier'] == BLOCK:
          proposed.append((len(step['proposed']), min(BLOCK, NEW_TOKENS - generated)))
        generated += len(step['committed'])
      assert len(proposed) >= 2 and all(n == whole for n, whole in proposed), proposed


@pytest.mark.slow
def test_bad_drafter_settings_are_one_line_errors(toy):
  with pytest.raises(ValueError, match=r'drafters.dspark.num_draft must be in \[1, 4\]'):
    toy['drafter'].with_num_draft(BLOCK + 1)
  with pytest.raises(ValueError, match='drafters.dspark.verify_cost'):
    dataclasses.replace(toy['drafter'], verify_cost=-1.0)
  cfg = dspark_demo.get_config('tiny')
  cfg.drafters.dspark.path = ''
  with pytest.raises(ValueError, match='drafters.dspark.path'):
    registry.build_drafter(cfg, toy['target'])
  with pytest.raises(ValueError, match='width'):
    toy['drafter'].check_target(dataclasses.replace(TOY, embed_dim=48))
