"""Tree verification in the decoding loop: greedy tree output == AR output token for token
(ragged batch, trees cut at the budget, stop tokens inside a tree), a chain tree steps
like the chain engine, the trace records each step's tree and accepted path, and DFlash top-k trees keep the target's distribution at T > 0."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import generate
from dspec.decoding.prompts import pad_prompts
from lossless_checks import check_engine_samples_match_target
from dspec.decoding.drafters.dflash import DFlashDrafter
from dspec.decoding.drafters.ngram import NgramDrafter
from dspec.decoding.drafters.self_draft import SelfDrafter
from dspec.decoding.engine import SpeculativeEngine
from dspec.decoding import runner
from dspec.decoding.costs import CostTable
from dspec.decoding.policy import ControllerConfig
from dspec.decoding.runner import trace_of
from dspec.decoding.tree import DraftTree
from dspec.decoding.tree_engine import TreeConfig, TreeEngine
from dspec.decoding.tree_proposers import BlockTopKTrees, ChainTrees, SelectorTrees
from dspec.models import dflash2
from dspec.models.dflash import DFlashConfig, DFlashModel
from dspec.sampling import SamplingSpec

PROMPTS = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [9, 9, 1], [7, 20, 31, 7, 20, 31, 7, 44, 2, 7, 20]]
NEW_TOKENS = 19


@dataclasses.dataclass(frozen=True)
class CombTrees:
  """Test proposer: the self-drafter's (correct, at T = 0) chain, each draft preceded by a
  wrong sibling, so the accepted path runs through non-first children (nodes 2, 4, ...)."""

  def propose_tree(self, drafter, params, state, target, ctx, key, num_nodes):
    chain = drafter.propose(params, state, target, ctx, key).tokens_BG
    b, g = chain.shape
    wrong = (chain + 1) % target.cfg.vocab_size
    tokens = jnp.stack([wrong, chain], axis=2).reshape(b, 2 * g)
    parents = jnp.asarray([-1] + [2 * (i // 2) for i in range(2 * g)], jnp.int32)
    anchor = ctx.tokens_BL[jnp.arange(b), ctx.num_tokens_B - 1]
    return DraftTree(jnp.concatenate([anchor[:, None], tokens], axis=1),
                     jnp.broadcast_to(parents, (b, 2 * g + 1)),
                     jnp.full((b,), 2 * g + 1, jnp.int32))


@pytest.fixture(scope='module')
def ar_outputs(tiny_split):
  return generate(SpeculativeEngine(tiny_split[0]), tiny_split[1], None, PROMPTS,
                  NEW_TOKENS)[0]


def _tiny_dflash(target_cfg, block_size=5, seed=5):
  cfg = DFlashConfig.create(target_cfg.num_layers, num_layers=1, block_size=block_size,
                            mask_token_id=11)
  return DFlashDrafter.create(DFlashModel(cfg, target_cfg, rngs=nnx.Rngs(seed)))


def _tiny_dflash2(target_cfg, block_size=5, seed=6):
  cfg = dflash2.DFlash2Config.create(num_target_layers=target_cfg.num_layers, num_layers=1,
                                     block_size=block_size, mask_token_id=11,
                                     conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                                     selector_top_k=4)
  model = dflash2.DFlash2Model(cfg, target_cfg, rngs=nnx.Rngs(seed))
  # Pair scores big enough to re-rank the slot logits' candidates.
  selector = model.candidate_selector
  for i, w in enumerate((selector.predecessor_codebook, selector.successor_codebook,
                         selector.hidden_projection.kernel)):
    w[...] = jax.random.normal(jax.random.key(seed + i), w.shape)
  return DFlashDrafter.create(model)


@pytest.mark.slow
def test_comb_trees_accept_through_later_siblings(tiny_split, ar_outputs):
  engine = TreeEngine(SpeculativeEngine(tiny_split[0], drafter=SelfDrafter(num_draft=4)),
                      CombTrees(), num_nodes=9, max_depth=4)
  outs, state = generate(engine, tiny_split[1], None, PROMPTS, NEW_TOKENS)
  assert outs == ar_outputs
  stats = state.stats
  # Each full step accepts its 4 correct drafts (nodes 2, 4, 6, 8) and commits 5 tokens.
  # Near the end of the buffer (prompt + budget) a tree keeps only the nodes with a cache
  # slot left: 5 nodes (2 correct) for row 0's last step; row 2 (longest prompt) gets 4
  # nodes, then 2; row 1 (shortest) keeps its whole last tree, cut at the budget (3).
  np.testing.assert_array_equal(stats.committed_B, [NEW_TOKENS - 1] * 3)
  np.testing.assert_array_equal(stats.steps_B, [4, 4, 5])
  np.testing.assert_array_equal(stats.accepted_B, [12 + 2, 12 + 3, 12 + 1 + 0])


def test_trace_records_each_steps_tree_and_accepted_path(tiny_split, ar_outputs):
  engine = TreeEngine(SpeculativeEngine(tiny_split[0], drafter=SelfDrafter(num_draft=4)),
                      CombTrees(), num_nodes=9, max_depth=4, trace=True)
  outs, state = generate(engine, tiny_split[1], None, PROMPTS, NEW_TOKENS)
  assert outs == ar_outputs
  trace = trace_of(state)
  committed = [trace['first_token']]
  for step in trace['steps']:
    tokens, parents = step['tree']['tokens'], step['tree']['parents']
    path = step['accepted_path']
    assert len(path) == step['accepted'] + 1 and path[0] == 0 and parents[0] == -1
    assert all(parents[child] == parent for parent, child in zip(path, path[1:]))
    assert step['committed'][:step['accepted']] == [tokens[n] for n in path[1:]]
    committed += step['committed']
  assert committed == ar_outputs[0]
  assert trace['steps'][0]['accepted_path'] == [0, 2, 4, 6, 8]   # the correct siblings
  assert len(trace['steps']) == int(state.stats.steps_B[0])


@pytest.mark.slow
def test_auto_tree_traces_each_steps_tier_and_tree(tiny_split, ar_outputs):
  """`auto_tree` with a trace: every step of row 0 records its tier; a tree tier's step
  its tree and accepted path, a tier-0 (AR) step no tree. The steps' commits are AR's."""
  tiers = (0, 3)
  controller = runner.speculative_engine(
      tiny_split[0], SelfDrafter(num_draft=4), verify_length='auto_tree', trace=True,
      tree=TreeConfig(num_nodes=8, top_k=2), controller=ControllerConfig(
          tiers=tiers, steps_per_decision=1, max_steps_per_decision=2, probe_every=2),
      cost_table=CostTable({(3, g): 1.0 + 0.3 * g for g in tiers + (7,)}, {3: 1e9}))
  outs, state = generate(controller, tiny_split[1], None, PROMPTS, NEW_TOKENS)
  assert outs == ar_outputs
  trace = trace_of(state, controller.row0_tiers)
  committed = [trace['first_token']]
  for step in trace['steps']:
    tokens, path = step['tree']['tokens'], step['accepted_path']
    if step['tier']:
      assert len(path) == step['accepted'] + 1 and path[0] == 0 and len(tokens) > 1
      assert step['committed'][:step['accepted']] == [tokens[n] for n in path[1:]]
    else:
      assert tokens == [] and step['accepted'] == 0 and len(step['committed']) == 1
    committed += step['committed']
  assert committed == ar_outputs[0]
  seen = {s['tier'] for s in trace['steps']}
  assert 0 in seen and seen - {0}, seen   # AR steps and tree steps, both traced


@pytest.mark.slow
@pytest.mark.parametrize('num_nodes', [1, 6, 16])
def test_dflash_topk_trees_equal_ar(tiny_split, tiny_model, ar_outputs, num_nodes):
  drafter, dparams = _tiny_dflash(tiny_model.cfg)
  engine = TreeEngine(SpeculativeEngine(tiny_split[0], drafter=drafter),
                      BlockTopKTrees(top_k=3), num_nodes=num_nodes,
                      max_depth=min(num_nodes - 1, drafter.num_draft))
  outs, _ = generate(engine, tiny_split[1], dparams, PROMPTS, NEW_TOKENS)
  assert outs == ar_outputs


@pytest.mark.slow
def test_dflash2_selector_trees(tiny_split, tiny_model, ar_outputs):
  """top_k = 1: the selector's greedy walk, step for step; wider trees: AR's tokens and
  at least the chain's tau."""
  drafter, dparams = _tiny_dflash2(tiny_model.cfg)
  assert isinstance(drafter.tree_proposer(3), SelectorTrees)
  chain = SpeculativeEngine(tiny_split[0], drafter=drafter)
  prompt_BP, lens = pad_prompts(PROMPTS)
  state = chain.prefill(*tiny_split[1:], dparams, prompt_BP, lens, max_new_tokens=NEW_TOKENS)
  ctx, key = chain.context(state), jax.random.key(0)
  proposal = drafter.propose(dparams, state.drafter_state, tiny_model, ctx, key)
  walk = SelectorTrees(top_k=1).propose_tree(drafter, dparams, state.drafter_state,
                                             tiny_model, ctx, key, num_nodes=5)
  np.testing.assert_array_equal(walk.tokens_BN[:, 1:], proposal.tokens_BG)
  np.testing.assert_array_equal(walk.parents_BN, np.broadcast_to(np.arange(5) - 1, (3, 5)))
  unary = BlockTopKTrees(top_k=1).propose_tree(drafter, dparams, state.drafter_state,
                                               tiny_model, ctx, key, num_nodes=5)
  assert not np.array_equal(unary.tokens_BN, walk.tokens_BN)   # the selector re-ranks
  want, want_state = generate(chain, tiny_split[1], dparams, PROMPTS, NEW_TOKENS)
  tree = TreeEngine(chain, SelectorTrees(top_k=3), num_nodes=16, max_depth=4)
  got, tree_state = generate(tree, tiny_split[1], dparams, PROMPTS, NEW_TOKENS)
  assert want == got == ar_outputs
  assert tree_state.stats.steps_B.sum() <= want_state.stats.steps_B.sum()


@pytest.mark.slow
@pytest.mark.parametrize('temperature', [1.0])
def test_dflash2_selector_trees_keep_the_target_distribution(small_vocab_model, temperature):
  drafter, dparams = _tiny_dflash2(small_vocab_model.cfg, block_size=3)
  graphdef, params = nnx.split(small_vocab_model)
  spec = SamplingSpec.create(temperature, 0, 1.0)
  engine = TreeEngine(SpeculativeEngine(graphdef, drafter=drafter, sampling=spec),
                      drafter.tree_proposer(3), num_nodes=7, max_depth=2)
  check_engine_samples_match_target(engine, small_vocab_model, params, dparams,
                                    [3, 1, 4, 1, 5, 9, 2, 6], temperature=temperature,
                                    num_samples=20_000, num_tokens=2,
                                    max_new_tokens=2 + 7)   # room for whole trees


@pytest.mark.slow
def test_chain_trees_step_like_the_chain_engine(tiny_split, ar_outputs):
  chain = SpeculativeEngine(tiny_split[0], drafter=NgramDrafter(num_draft=5, min_n=1,
                                                                max_n=3), stop_ids=(44,))
  # 8 nodes: the chain's tree (6) is smaller than the engine's (and its trace's) width
  tree = TreeEngine(chain, ChainTrees(), num_nodes=8, max_depth=5, trace=True)
  want, want_state = generate(chain, tiny_split[1], None, PROMPTS, NEW_TOKENS)
  got, got_state = generate(tree, tiny_split[1], None, PROMPTS, NEW_TOKENS)
  assert got == want
  for field in ('steps_B', 'committed_B', 'accepted_B'):
    np.testing.assert_array_equal(getattr(got_state.stats, field),
                                  getattr(want_state.stats, field))
  assert int(want_state.stats.accepted_B.sum()) > 0


@pytest.mark.slow
def test_stop_token_inside_a_tree(tiny_split, ar_outputs):
  stop = ar_outputs[0][6]
  engine = TreeEngine(SpeculativeEngine(tiny_split[0], drafter=SelfDrafter(num_draft=4),
                                        stop_ids=(stop,)),
                      CombTrees(), num_nodes=9, max_depth=4)
  outs, _ = generate(engine, tiny_split[1], None, PROMPTS, NEW_TOKENS)
  for out, ref in zip(outs, ar_outputs):
    cut = ref.index(stop) + 1 if stop in ref else len(ref)
    assert out == ref[:cut]


@pytest.mark.slow
@pytest.mark.parametrize('temperature,top_p', [(1.0, 1.0), (0.7, 0.8)])
def test_dflash_topk_trees_keep_the_target_distribution(small_vocab_model, temperature,
                                                         top_p):
  drafter, dparams = _tiny_dflash(small_vocab_model.cfg, block_size=3)
  graphdef, params = nnx.split(small_vocab_model)
  spec = SamplingSpec.create(temperature, 0, top_p)
  engine = TreeEngine(SpeculativeEngine(graphdef, drafter=drafter, sampling=spec),
                      BlockTopKTrees(top_k=3), num_nodes=7, max_depth=2)
  check_engine_samples_match_target(engine, small_vocab_model, params, dparams,
                                    [3, 1, 4, 1, 5, 9, 2, 6], temperature=temperature,
                                    top_p=top_p, num_samples=20_000, num_tokens=2,
                                    max_new_tokens=2 + 7)   # room for whole trees
