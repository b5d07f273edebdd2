"""DSpark in DFlash's block layout (`sample_from_anchor=False`): started from a DFlash
export with its heads at zero it is that DFlash drafter (same drafts at decode and in the
slot-acceptance walk, the same teacher-forced terms), it decodes greedy = AR, it trains
from the export through the 'dspark' task and its speculators form keeps the layout.
"""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import generate
from configs import dspark_demo
from dspec import checkpoint
from dspec.decoding.drafters import registry
from dspec.decoding.drafters.dflash import DFlashDrafter
from dspec.decoding.drafters.dspark import DSparkDrafter
from dspec.decoding.engine import SpeculativeEngine
from dspec.decoding.prompts import pad_prompts
from dspec.models.dflash import DFlashConfig, DFlashModel, save_dflash
from dspec.models.dspark import DSparkConfig, DSparkModel
from dspec.models.formats.dspark import load_dspark, save_speculators, speculators_config
from dspec.training import dspark_task, slot_acceptance, tasks

BLOCK = 4   # anchor + 3 drafts
PROMPTS = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [9, 9, 1]]
NEW_TOKENS = 12


@pytest.fixture(scope='module')
def pair(tiny_model, tmp_path_factory):
  """(DFlash export dir, the DFlash drafter model, a DFlash-layout DSpark started from it)."""
  cfg = DFlashConfig.create(tiny_model.cfg.num_layers, 1, BLOCK, mask_token_id=1)
  dflash = DFlashModel(cfg, tiny_model.cfg, rngs=nnx.Rngs(5))
  path = str(tmp_path_factory.mktemp('layout') / 'dflash')
  save_dflash(path, dflash)
  dspark = DSparkModel(DSparkConfig.create(
      tiny_model.cfg.num_layers, 1, BLOCK, mask_token_id=1, markov_rank=8,
      sample_from_anchor=False), tiny_model.cfg, rngs=nnx.Rngs(6))
  fresh = checkpoint.load_backbone_state(path, dspark, 'dflash')
  assert fresh and all(n.startswith(('markov_head', 'confidence_head')) for n in fresh)
  return path, dflash, dspark


def test_a_dflash_export_is_the_dflash_layout_dspark_with_zero_heads(tiny_model, tiny_split,
                                                                    pair):
  _, dflash, dspark = pair
  assert dspark.cfg.num_drafts == BLOCK - 1
  graphdef, params = tiny_split
  d_drafter, d_params = DFlashDrafter.create(dflash)
  s_drafter, s_params = DSparkDrafter.create(dspark, verify_cost=0.0)
  assert s_drafter.num_draft == d_drafter.num_draft == BLOCK - 1
  proposals = []
  for drafter, dparams in ((d_drafter, d_params), (s_drafter, s_params)):
    engine = SpeculativeEngine(graphdef, drafter=drafter)
    prompt_BP, lens = pad_prompts(PROMPTS)
    state = engine.prefill(params, dparams, prompt_BP, lens, max_new_tokens=NEW_TOKENS)
    proposal = jax.jit(lambda dp, st: drafter.propose(
        dp, st.drafter_state, tiny_model, engine.context(st), jax.random.key(0)))(
            dparams, state)
    proposals.append(np.asarray(proposal.tokens_BG))
  np.testing.assert_array_equal(proposals[0], proposals[1])
  # The slot-acceptance walk (the decode-faithful τ) reads the same drafts.
  tokens_1S = np.array([PROMPTS[0] + [7, 8, 9, 10, 11, 12]], np.int32)
  anchors_1N = np.array([[3, 6, 9]], np.int32)
  walks = [np.asarray(slot_acceptance.anchor_drafts(m, tiny_model, tokens_1S, anchors_1N,
                                                    num_draft=BLOCK - 1))
           for m in (dflash, dspark)]
  np.testing.assert_array_equal(*walks)
  # Teacher-forced terms: draft slot k predicts a+k+1, as DFlash's block slot k+1 does.
  mask_1S = np.ones_like(tokens_1S, bool)
  terms = dspark_task.dspark_terms(dspark, tiny_model, tokens_1S, mask_1S, anchors_1N, 4.0)
  assert terms['hit'].shape == (1, 3, BLOCK - 1)
  labels = np.stack([tokens_1S[0, a + 1:a + BLOCK] for a in anchors_1N[0]])
  np.testing.assert_array_equal(np.asarray(terms['hit'][0]), walks[1][0] == labels)


def test_dflash_layout_decodes_greedy_equal_to_ar(tiny_split, pair):
  graphdef, params = tiny_split
  ar = generate(SpeculativeEngine(graphdef), params, None, PROMPTS, NEW_TOKENS)[0]
  dspark = pair[2]
  drafter, dparams = DSparkDrafter.create(dspark, verify_cost=0.15)
  assert generate(SpeculativeEngine(graphdef, drafter=drafter), params, dparams, PROMPTS,
                  NEW_TOKENS)[0] == ar


@pytest.mark.slow
def test_training_starts_from_a_dflash_export(tiny_model, tiny_split, pair, tmp_path):
  """The 'dspark' task in DFlash's layout starts from the export (its backbone, heads
  fresh), trains and exports B − 1 calibration temperatures; the export decodes greedy =
  AR."""
  path = pair[0]
  target_dir = str(tmp_path / 'target')
  checkpoint.save_model(target_dir, tiny_model, kind='target', config=tiny_model.cfg.to_dict())
  data_dir = tmp_path / 'data'
  data_dir.mkdir()
  seq = np.array([PROMPTS[0] + list(range(10, 30))] * 2, np.int32)
  np.savez(data_dir / 'shard_00000.npz', tokens=seq,
           loss_mask=np.arange(seq.shape[1])[None].repeat(2, 0) >= len(PROMPTS[0]),
           lengths=np.array([seq.shape[1]] * 2, np.int32))
  (data_dir / 'manifest.json').write_text(json.dumps({'shards': ['shard_00000.npz'],
                                                      'complete': True}))
  cfg = dspark_demo.get_config(f'tiny,block={BLOCK},rank=8,layers=1')
  cfg.dspark.sample_from_anchor = False
  cfg.dspark.mask_token_id = 1
  cfg.model.source, cfg.model.path = 'checkpoint', target_dir
  cfg.data.path, cfg.data.heldout_fraction = str(data_dir), 0.5
  cfg.training.update(num_steps=2, batch_size=2, seq_len=seq.shape[1], log_every=2,
                      eval_every=2, ckpt_every=2, init_from=path)
  tasks.run_training(cfg, str(tmp_path / 'run'))
  cfg.drafters.dspark.path = str(tmp_path / 'run' / 'final')
  cfg.drafters.dspark.num_draft = 0
  drafter, dparams = registry.build_drafter(cfg, tiny_model)
  assert drafter.num_draft == BLOCK - 1 and not drafter.config.sample_from_anchor
  assert len(drafter.config.greedy_confidence_temperatures) == BLOCK - 1
  graphdef, params = tiny_split
  ar = generate(SpeculativeEngine(graphdef), params, None, PROMPTS, NEW_TOKENS)[0]
  assert generate(SpeculativeEngine(graphdef, drafter=drafter), params, dparams, PROMPTS,
                  NEW_TOKENS)[0] == ar


def test_the_speculators_form_keeps_the_layout(tiny_model, tmp_path):
  model = DSparkModel(DSparkConfig.create(
      tiny_model.cfg.num_layers, 1, BLOCK, mask_token_id=1, markov_rank=8,
      target_layer_ids=(0,), sample_from_anchor=False), tiny_model.cfg, rngs=nnx.Rngs(7))
  spec = speculators_config(model)
  assert spec['sample_from_anchor'] is False
  assert spec['speculators_config']['proposal_methods'][0]['speculative_tokens'] == BLOCK - 1
  save_speculators(tmp_path / 's', model)
  back = load_dspark(tmp_path / 's', num_target_layers=tiny_model.cfg.num_layers)
  assert not back.cfg.sample_from_anchor and back.cfg.num_drafts == BLOCK - 1


def test_the_recurrent_head_needs_anchor_first_blocks():
  with pytest.raises(ValueError, match='sample_from_anchor=True'):
    DSparkConfig.create(2, 1, BLOCK, mask_token_id=1, markov_rank=8, markov_head_type='rnn',
                        sample_from_anchor=False)
  assert dataclasses.replace(DSparkConfig.create(2, 1, BLOCK, mask_token_id=1, markov_rank=8),
                             block_size=5).num_drafts == 5
