"""N-gram trees (`NgramTrees`): the continuations of the most recent matches merged into a
trie (most recent first, shared prefixes shared, cut at num_nodes), top_k = 1 is the chain
proposal, no match is the root alone; greedy tree decoding == AR token for token (ragged
batch) and commits more per step than the chain; sampled tree decoding keeps the target's
distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import generate
from lossless_checks import chi_square_pvalue, exact_joint, joint_counts
from dspec.decoding.drafters.ngram import NgramDrafter
from dspec.decoding.engine import SpeculativeEngine
from dspec.decoding.runner import speculative_engine
from dspec.decoding.state import DraftContext
from dspec.decoding.tree_engine import TreeConfig
from dspec.decoding.tree_proposers import ChainTrees
from dspec.sampling import SamplingSpec

# Row 0: the suffix [1, 2] (no [4, 1, 2] earlier) ends at 2, 7 and 11, followed by
# [5, 6, 7, 1], [8, 9, 1, 2] and [5, 6, 3, 4]. Row 1: one match, whose continuation wraps
# (period 3). Rows 2 and 3: no match.
ROWS = [[1, 2, 5, 6, 7, 1, 2, 8, 9, 1, 2, 5, 6, 3, 4, 1, 2], [7, 8, 9, 7, 8], [1, 2, 3, 4, 5],
        [6]]
DRAFTER = NgramDrafter(num_draft=4, min_n=1, max_n=3)
# Row 0's trie: the match at 11 (nodes 1-4), at 7 (nodes 5-8), at 2 (shares nodes 1-2,
# its [5, 6] prefix, then nodes 9-10).
TRIE_TOKENS = [2, 5, 6, 3, 4, 8, 9, 1, 2, 7, 1]
TRIE_PARENTS = [-1, 0, 1, 2, 3, 0, 5, 6, 7, 2, 9]


def _context(tokens_BL, num_tokens_B):
  return DraftContext(tokens_BL, num_tokens_B, SamplingSpec(), jnp.float32(0), jnp.float32(1))


@jax.jit
def _trees(tokens_BL, num_tokens_B):
  ctx = _context(tokens_BL, num_tokens_B)
  tree = lambda k, n: DRAFTER.tree_proposer(k).propose_tree(DRAFTER, None, None, None, ctx,
                                                            None, n)
  chain = ChainTrees().propose_tree(DRAFTER, None, None, None, ctx, None, 16)
  return {'k3': tree(3, 16), 'k3_cut': tree(3, 10), 'k1': tree(1, 16), 'chain': chain}


@pytest.fixture(scope='module')
def trees():
  tokens = np.zeros((len(ROWS), 20), np.int32)
  for i, row in enumerate(ROWS):
    tokens[i, :len(row)] = row
  out = _trees(jnp.asarray(tokens), jnp.asarray([len(r) for r in ROWS], jnp.int32))
  return jax.tree.map(np.asarray, out)


def test_matches_merge_into_a_trie_most_recent_first(trees):
  tree = trees['k3'].check()
  assert tree.tokens_BN.shape == (4, 13)   # 1 + top_k * num_draft nodes (< num_nodes)
  np.testing.assert_array_equal(tree.num_nodes_B, [11, 5, 1, 1])
  np.testing.assert_array_equal(tree.tokens_BN[0, :11], TRIE_TOKENS)
  np.testing.assert_array_equal(tree.parents_BN[0], TRIE_PARENTS + [-1, -1])
  np.testing.assert_array_equal(tree.tokens_BN[1, :5], [8, 9, 7, 8, 9])   # wrapped
  np.testing.assert_array_equal(tree.parents_BN[1, :5], [-1, 0, 1, 2, 3])
  # Cut at 10 nodes: the oldest match's last node (child of node 9) goes first.
  cut = trees['k3_cut'].check()
  np.testing.assert_array_equal(cut.num_nodes_B, [10, 5, 1, 1])
  np.testing.assert_array_equal(cut.tokens_BN[0], TRIE_TOKENS[:10])
  np.testing.assert_array_equal(cut.parents_BN[0], TRIE_PARENTS[:10])
  # top_k = 1: the chain proposal.
  one, chain = trees['k1'].check(), trees['chain']
  assert one.tokens_BN.shape == chain.tokens_BN.shape == (4, 5)
  np.testing.assert_array_equal(one.num_nodes_B, chain.num_nodes_B)
  np.testing.assert_array_equal(one.parents_BN, chain.parents_BN)
  np.testing.assert_array_equal(one.tokens_BN[:2], chain.tokens_BN[:2])
  np.testing.assert_array_equal(one.tokens_BN[0], [2, 5, 6, 3, 4])


def test_no_match_is_the_root_alone(trees):
  for name in ('k3', 'k3_cut', 'k1'):
    tree = trees[name]
    np.testing.assert_array_equal(tree.num_nodes_B[2:], [1, 1])
    np.testing.assert_array_equal(tree.parents_BN[2:], -1)
    np.testing.assert_array_equal(tree.tokens_BN[2:, 0], [5, 6])   # the anchors


# Repetitive prompts (small alphabets) on which older matches pay off; ragged.
PROMPTS = [[47, 31, 35, 31, 31, 35, 35, 35, 47, 31], [48, 13, 38, 38, 13, 13, 38],
           [31, 32, 31, 48, 32, 25, 25, 32, 48]]
NEW_TOKENS = 19


@pytest.mark.slow
def test_greedy_ngram_trees_equal_ar_and_beat_the_chain(tiny_split):
  graphdef, params = tiny_split
  ar = generate(SpeculativeEngine(graphdef), params, None, PROMPTS, NEW_TOKENS)[0]
  chain = speculative_engine(graphdef, DRAFTER, SamplingSpec(), (), verify_length='fixed')
  tree = speculative_engine(graphdef, DRAFTER, SamplingSpec(), (), verify_length='tree',
                            tree=TreeConfig(num_nodes=16, top_k=3))
  chain_outs, chain_state = generate(chain, params, None, PROMPTS, NEW_TOKENS)
  outs, tree_state = generate(tree, params, None, PROMPTS, NEW_TOKENS)
  assert chain_outs == ar
  assert outs == ar
  tau = lambda s: float(s.stats.committed_B.sum()) / float(s.stats.steps_B.sum())
  assert tau(tree_state) > tau(chain_state), (tau(tree_state), tau(chain_state))


# Every token is followed by three different tokens in the prompt, so whatever the first
# sampled token, the next tree has three branches at the root.
SAMPLING_PROMPT = [3, 4, 11, 9, 2, 7, 8, 0, 10, 1, 6, 5, 0, 11, 8, 10, 7, 5, 9, 1, 2, 3, 6,
                   4, 0, 7, 9, 10, 3, 1, 4, 5, 6, 2, 8, 11]


@pytest.mark.slow
def test_ngram_trees_keep_the_target_distribution(small_vocab_model):
  """The first 3 generated tokens' joint (the prefill's token, then two tree steps) against
  the target's. The budget leaves the first tree its 7 nodes (a tree is cut to the cache
  slots left, which `sample_engine`'s budget of 3 would make a 3-node chain)."""
  graphdef, params = nnx.split(small_vocab_model)
  drafter = NgramDrafter(num_draft=2, min_n=1, max_n=1)
  engine = speculative_engine(graphdef, drafter, SamplingSpec.create(1.0, 0, 1.0), (),
                              verify_length='tree', tree=TreeConfig(num_nodes=7, top_k=3))
  num_samples, num_tokens, p = 20_000, 3, len(SAMPLING_PROMPT)
  state = engine.prefill(params, None, np.tile(np.asarray(SAMPLING_PROMPT, np.int32),
                                               (num_samples, 1)),
                         np.full((num_samples,), p, np.int32), temperature=1.0,
                         max_new_tokens=7, seed=0)
  state = engine.run(params, None, state, max_steps=2)   # each step commits >= 1 token
  stats, tokens = jax.device_get((state.stats, state.tokens_BL))
  assert np.all(stats.proposed_B > drafter.num_draft * stats.steps_B)   # the trees branch
  samples = tokens[:, p:p + num_tokens]
  expected = exact_joint(small_vocab_model, SAMPLING_PROMPT, num_tokens, engine.sampling,
                         1.0, 1.0)
  vocab = small_vocab_model.cfg.vocab_size
  p_joint = chi_square_pvalue(joint_counts(samples, vocab), expected)
  p_first2 = chi_square_pvalue(joint_counts(samples[:, :2], vocab), expected.sum(axis=2))
  assert p_joint > 1e-3 and p_first2 > 1e-3, (p_joint, p_first2)
