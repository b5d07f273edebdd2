"""EAGLE-2 dynamic trees (`BeamTrees`) from autoregressive drafters: every node's
children are its path's top-k draft tokens (the draft state carried per beam node), the
trees branch, greedy tree decoding == AR token for token (ragged batch, a stop token),
τ(tree) > τ(chain), and sampled tree decoding keeps the target's distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import TINY, generate
from lossless_checks import check_engine_samples_match_target
from dspec.decoding.drafters.eagle3 import Eagle3Drafter
from dspec.decoding.drafters.mtp import MTPDrafter
from dspec.decoding.engine import SpeculativeEngine
from dspec.decoding.prompts import pad_prompts
from dspec.decoding.state import DraftContext
from dspec.decoding.tree_engine import TreeEngine
from dspec.decoding.tree_proposers import BeamTrees, TreeGrower, chain_lengths
from dspec.models.eagle3 import Eagle3Config, Eagle3Model
from dspec.models.mtp import MTP, MTPConfig
from dspec.models.transformer import TargetOutput
from dspec.sampling import SamplingSpec

PROMPTS = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [9, 9, 1], [7, 20, 31, 7, 20, 31, 7, 44, 2, 7, 20]]
NEW_TOKENS = 19
VOCAB = tuple(sorted(set(range(0, 64, 2)) | set(range(1, 20, 2))))   # a reduced head


def _eagle3(target, target_cfg=TINY, scale=10.0, **fields):
  """A random EAGLE-3 (head from the target's rows, a layer that matters)."""
  fields = dict(dict(target_layer_ids=(1, 0, 1), draft_vocab=VOCAB, final_tap_normed=True),
                **fields)
  model = Eagle3Model(Eagle3Config(**fields), target_cfg, rngs=nnx.Rngs(1))
  model.init_head_from(target)
  for layer in model.layers:
    layer.mlp.down_proj.kernel[...] *= scale
  return model


def _children(tree, row):
  parents = np.asarray(tree.parents_BN[row])[:int(tree.num_nodes_B[row])]
  return {p: [n for n in range(len(parents)) if parents[n] == p] for p in set(parents[1:])}


class RecordingGrower(TreeGrower):
  """A `TreeGrower` that keeps every expansion's (logits, new beam's parent slots, tokens)."""

  def __init__(self, batch, top_k):
    super().__init__(batch, top_k)
    self.records = []

  def expand(self, logits_BWV, token_ids):
    parent_BW, tokens_BW = super().expand(logits_BWV, token_ids)
    self.records.append((logits_BWV, parent_BW, tokens_BW))
    return parent_BW, tokens_BW


def _mtp(cfg, target_cfg=TINY, scale=10.0):
  """A random MTP whose blocks matter."""
  mtp = MTP(cfg, target_cfg, rngs=nnx.Rngs(1))
  for depth in mtp.depths:
    depth.layer.mlp.down_proj.kernel[...] *= scale
  return mtp


def _eagle3_case(target, fields):
  model = _eagle3(target, **fields)
  drafter, params = Eagle3Drafter.create(model, 4)

  def reference(full, seq_BL, n_B):
    outs = model.ttt_logits(target, model.fuse(full.taps_BTND, target), seq_BL, 4)
    return [o[jnp.arange(seq_BL.shape[0]), n_B - 2] for o in outs]

  return drafter, params, reference


def _mtp_case(target, cfg):
  mtp = _mtp(cfg)
  drafter, params = MTPDrafter.from_model(mtp)

  def reference(full, seq_BL, n_B):
    outs = mtp(target, mtp.h0(full), seq_BL, num_depths=drafter.num_draft)
    return [target.logits(o)[jnp.arange(seq_BL.shape[0]), n_B - 2] for o in outs]

  return drafter, params, reference


CASES = {
    'eagle3': lambda t: _eagle3_case(t, {}),
    'eagle3_options': lambda t: _eagle3_case(t, dict(num_layers=2, norm_output=True)),
    'mtp_chained': lambda t: _mtp_case(t, MTPConfig(num_depths=4)),
    'mtp_parallel': lambda t: _mtp_case(t, MTPConfig(num_depths=3, kind='parallel')),
}


# mtp_parallel: the module's quick test (`pytest -m 'not slow and not multiprocess'`).
@pytest.mark.parametrize('case', [c if c == 'mtp_parallel' else
                                  pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_beam_nodes_draft_along_their_own_paths(tiny_model, case):
  """Each beam node's draft logits equal the drafter's training pass (EAGLE-3's TTT,
  MTP's full causal pass) at n-2 over the committed tokens followed by the node's own
  path: its draft state and attention are its path's alone. The tree branches below
  depth 1, and top_k = 1 gives the chain's drafts."""
  target = tiny_model
  drafter, params, reference = CASES[case](target)
  gamma, top_k = drafter.num_draft, 3
  b, length = 2, 40
  seq = np.random.default_rng(0).integers(1, 64, (b, length)).astype(np.int32)
  full = jax.jit(lambda t, s: t(s, taps=drafter.taps))(target, seq)
  n = jnp.asarray([12, 7], jnp.int32)
  ctx_of = lambda s, m: DraftContext(jnp.where(jnp.arange(length)[None] < m[:, None], s, 0),
                                     m, SamplingSpec(), jnp.float32(0), jnp.float32(1))
  w = int(n.max()) - 1
  state = jax.jit(lambda p, t, s, m: drafter.init(p, t, ctx_of(s, m), TargetOutput(
      None, full.hidden_BTD[:, :w], full.taps_BTND[:, :w], None)))(params, target, seq, n)

  @jax.jit
  def grow(p, t, st, s, m):
    grower = RecordingGrower(b, top_k)
    drafter.grow_tree(p, st, t, ctx_of(s, m), grower, gamma)
    return grower.records, grower.tree(s[jnp.arange(b), m - 1], 14)

  records, tree = grow(params, target, state, seq, n)
  chain = jax.jit(lambda p, t, st, s, m: drafter.draft(p, st, t, ctx_of(s, m),
                                                       jax.random.key(0))[0])(
      params, target, state, seq, n)
  tree1 = jax.jit(lambda p, t, st, s, m: BeamTrees(1).propose_tree(
      drafter, p, st, t, ctx_of(s, m), None, 14))(params, target, state, seq, n)
  np.testing.assert_array_equal(np.asarray(tree1.tokens_BN[:, 1:gamma + 1]), chain)
  np.testing.assert_array_equal(np.asarray(tree1.parents_BN[:, :gamma + 1]),
                                [list(range(-1, gamma))] * b)

  # Beam node paths, depth by depth (record d: the depth-d beam's logits).
  paths = [[[]] for _ in range(b)]
  cases = []   # (row, depth, path, logits)
  for logits, parent, tokens in records:
    for r in range(b):
      cases += [(r, len(pth), pth, np.asarray(logits[r, i])) for i, pth in enumerate(paths[r])]
    paths = [[paths[r][int(p)] + [int(t)] for p, t in zip(parent[r], tokens[r])]
             for r in range(b)]
  assert len(cases) == b * (1 + top_k * (gamma - 1))
  rows = np.zeros((len(cases), length), np.int32)
  for i, (r, _, pth, _) in enumerate(cases):
    row = list(seq[r, :int(n[r])]) + pth
    rows[i, :len(row)] = row
  which = np.asarray([r for r, *_ in cases])
  ref = jax.jit(lambda f, s, a: reference(f, s, a))(
      jax.tree.map(lambda x: x[which], full), jnp.asarray(rows),
      jnp.asarray(n)[which])
  for i, (r, depth, pth, got) in enumerate(cases):
    np.testing.assert_allclose(got, np.asarray(ref[depth][i]), atol=1e-4, rtol=1e-4,
                               err_msg=f'row {r} path {pth}')
  assert any(len(c) > 1 for r in range(b) for p, c in _children(tree, r).items() if p > 0)


@pytest.fixture(scope='module')
def ar_outputs(tiny_split):
  return generate(SpeculativeEngine(tiny_split[0]), tiny_split[1], None, PROMPTS,
                  NEW_TOKENS)[0]


AR_DRAFTERS = {
    'eagle3': lambda t: Eagle3Drafter.create(_eagle3(t), 3),
    'mtp_chained': lambda t: MTPDrafter.from_model(_mtp(MTPConfig(num_depths=3))),
}


@pytest.mark.slow
@pytest.mark.parametrize('kind', list(AR_DRAFTERS))
def test_trees_equal_ar_and_beat_the_chain(tiny_split, tiny_model, ar_outputs, kind):
  drafter, dparams = AR_DRAFTERS[kind](tiny_model)
  chain = SpeculativeEngine(tiny_split[0], drafter=drafter)
  tree = TreeEngine(chain, drafter.tree_proposer(3), num_nodes=16, max_depth=3)
  outs, tree_state = generate(tree, tiny_split[1], dparams, PROMPTS, NEW_TOKENS)
  assert outs == ar_outputs
  chain_outs, chain_state = generate(chain, tiny_split[1], dparams, PROMPTS, NEW_TOKENS)
  assert chain_outs == ar_outputs
  tau = lambda s: float(s.stats.committed_B.sum()) / float(s.stats.steps_B.sum())
  # A random drafter's chain rarely lands; its tree's second and third candidates do.
  assert tau(tree_state) > tau(chain_state), (tau(tree_state), tau(chain_state))


@pytest.mark.slow
def test_eagle3_trees_stop_token(tiny_split, tiny_model, ar_outputs):
  stop = ar_outputs[0][6]
  drafter, dparams = Eagle3Drafter.create(_eagle3(tiny_model), 3)
  engine = TreeEngine(SpeculativeEngine(tiny_split[0], drafter=drafter, stop_ids=(stop,)),
                      drafter.tree_proposer(2), num_nodes=8, max_depth=3)
  outs, _ = generate(engine, tiny_split[1], dparams, PROMPTS, NEW_TOKENS)
  for out, ref in zip(outs, ar_outputs):
    assert out == (ref[:ref.index(stop) + 1] if stop in ref else ref)


SAMPLED_DRAFTERS = {   # on the small-vocabulary target
    'eagle3': lambda t: Eagle3Drafter.create(   # 3 sampled chains of 2, reduced vocab
        _eagle3(t, target_cfg=t.cfg, scale=30.0, target_layer_ids=(0, 1),
                draft_vocab=(0, 2, 3, 5, 7, 8, 11)), 3),
    'mtp': lambda t: MTPDrafter.from_model(_mtp(MTPConfig(num_depths=2), target_cfg=t.cfg)),
}


@pytest.mark.slow
@pytest.mark.parametrize('kind', list(SAMPLED_DRAFTERS))
def test_sampled_trees_keep_the_target_distribution(small_vocab_model, kind):
  graphdef, params = nnx.split(small_vocab_model)
  drafter, dparams = SAMPLED_DRAFTERS[kind](small_vocab_model)
  engine = TreeEngine(SpeculativeEngine(graphdef, drafter=drafter,
                                        sampling=SamplingSpec(greedy=False)),
                      drafter.tree_proposer(3), num_nodes=7, max_depth=drafter.num_draft)
  check_engine_samples_match_target(engine, small_vocab_model, params, dparams,
                                    [1, 5, 2, 7], temperature=1.0, num_samples=20_000,
                                    num_tokens=2, max_new_tokens=2 + 7)   # whole trees


@pytest.mark.slow
def test_sampled_trees_are_chains_under_sampled_siblings(tiny_model):
  """At T > 0 a beam drafter's tree is top_k sampled chains: distinct root children, each
  node's q its own draft distribution, chains shortened when the node budget binds."""
  drafter, dparams = AR_DRAFTERS['eagle3'](tiny_model)
  graphdef, params = nnx.split(tiny_model)
  engine = SpeculativeEngine(graphdef, drafter=drafter, sampling=SamplingSpec(greedy=False))
  prompt_BP, lens = pad_prompts(PROMPTS)
  state = engine.prefill(params, dparams, prompt_BP, lens, temperature=1.0,
                         max_new_tokens=NEW_TOKENS)
  tree = drafter.tree_proposer(4).propose_tree(drafter, dparams, state.drafter_state,
                                               tiny_model, engine.context(state),
                                               jax.random.key(1), num_nodes=16)
  assert tree.sibling_draw == 'without_replacement'
  tree.check()
  np.testing.assert_array_equal(tree.num_nodes_B, 1 + 4 * 3)
  parents = np.asarray(tree.parents_BN[0, :13])
  np.testing.assert_array_equal(parents, [-1, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8])
  roots = np.asarray(tree.tokens_BN[:, 1:5])
  assert all(len(set(r)) == 4 for r in roots)   # drawn without replacement
  q = np.asarray(tree.q_BNV)
  np.testing.assert_allclose(q[:, :9].sum(-1), 1.0, atol=1e-5)   # nodes with children
  assert np.all(q[np.arange(3)[:, None], 0, roots] > 0)
  # The node budget shortens the chains first (more root draws pay more at T > 0).
  assert chain_lengths(8, 7, 31) == (3,) * 8 and chain_lengths(5, 7, 3) == (1,) * 3
  short = drafter.tree_proposer(3).propose_tree(
      drafter, dparams, state.drafter_state, tiny_model, engine.context(state),
      jax.random.key(1), num_nodes=7)
  np.testing.assert_array_equal(short.parents_BN[0], [-1, 0, 0, 0, 1, 2, 3])
