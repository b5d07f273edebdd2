"""Exact χ² tests of tree verification against a synthetic target with a known joint.

The target is an explicit table over V = 6 tokens conditioned on the last two tokens;
its exact 3-token joint is a product of table rows. Each trial runs speculative steps
(draft a tree from the committed context, verify, commit) until 3 tokens are committed;
the trials run vectorised as the rows of one batch. Trees are adversarial: draft q
concentrated on the target's least likely tokens, duplicate siblings, every sibling
wrong (outside the top-p set), sampled with and without replacement and deterministic
top-k. The 2- and 3-token joints of the committed tokens are tested with Pearson χ² at
T = 1 and at T = 0.7 with top-p 0.8.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspec.decoding.tree import DraftTree
from dspec.decoding.tree_verification import greedy_tree_verify, rejection_tree_verify
from dspec.sampling import SamplingSpec, processed_probs
from lossless_checks import chi_square_pvalue, joint_counts

V = 6
PREFIX = (2, 4)
# root -> 1, 2, 3; 1 -> 4, 5; 4 -> 6; 2 -> 7 (depths 1, 1, 1, 2, 2, 3, 2).
PARENTS = (-1, 0, 0, 0, 1, 1, 4, 2)
MAX_DEPTH = 3
NUM_TOKENS = 3
NUM_TRIALS = 120_000
ALPHA = 1e-3


def _tables():
  rng = np.random.default_rng(0)
  target = rng.dirichlet(np.full(V, 0.7), size=(V, V))          # P[a, b, x]
  # q puts most mass on the target's least likely tokens (off its mode).
  rank = np.argsort(np.argsort(target, axis=-1), axis=-1)        # 0 = least likely
  draft = np.exp(-1.5 * rank) * rng.uniform(0.5, 1.5, target.shape)
  return target, draft / draft.sum(-1, keepdims=True)


TARGET, DRAFT = _tables()


def _processed(table, temperature, top_p):
  spec = SamplingSpec.create(temperature, 0, top_p)
  rows = processed_probs(jnp.log(jnp.asarray(table, jnp.float32)).reshape(-1, V), spec,
                         jnp.float32(temperature), jnp.float32(top_p))
  return np.asarray(rows, np.float64).reshape(table.shape)


def _exact_joint(p):
  a, b = PREFIX
  x1, x2, x3 = np.ix_(range(V), range(V), range(V))
  return p[a, b][x1] * p[b][x1, x2] * p[x1, x2, x3]


def _draw_tree(key, ctx_B2, q_table, p_table, kind):
  """Tokens, q and target rows [B, N, V] of a tree of shape PARENTS grown from `ctx`."""
  b, n = ctx_B2.shape[0], len(PARENTS)
  tokens = [ctx_B2[:, 1]]
  ctx = [ctx_B2]
  row = lambda table, c: table[c[:, 0], c[:, 1]]
  removed = {}   # parent -> mask of the tokens drawn so far (without replacement)
  for node in range(1, n):
    parent = PARENTS[node]
    q = row(q_table, ctx[parent])
    rank = sum(PARENTS[m] == parent for m in range(1, node))
    node_key = jax.random.fold_in(key, node)
    if kind == 'with_replacement':
      tok = jax.random.categorical(node_key, jnp.log(q))
    elif kind == 'without_replacement':
      left = removed.get(parent, jnp.ones_like(q))
      tok = jax.random.categorical(node_key, jnp.log(q * left))
      removed[parent] = left * (1 - jax.nn.one_hot(tok, V))
    elif kind == 'top_k':      # deterministic: the rank-th most likely draft token
      tok = jnp.argsort(-q, axis=-1)[:, rank]
    else:                      # 'all_wrong': the target's least likely tokens, duplicated
      tok = jnp.argsort(row(p_table, ctx[parent]), axis=-1)[:, max(rank - 1, 0)]
    tok = tok.astype(jnp.int32)
    tokens.append(tok)
    ctx.append(jnp.stack([ctx[parent][:, 1], tok], axis=1))
  q_rows = [row(q_table, c) for c in ctx]
  p_BNV = jnp.stack([row(p_table, c) for c in ctx], axis=1)
  draw = kind if kind in ('with_replacement', 'without_replacement') else 'deterministic'
  tree = DraftTree(jnp.stack(tokens, axis=1),
                   jnp.broadcast_to(jnp.asarray(PARENTS, jnp.int32), (b, n)),
                   jnp.full((b,), n, jnp.int32), jnp.stack(q_rows, axis=1), draw)
  return tree, p_BNV


@functools.partial(jax.jit, static_argnames=('kind', 'greedy'))
def _committed(key, q_table, p_table, kind, greedy=False):
  """The first NUM_TOKENS committed tokens of NUM_TRIALS independent decodes."""
  b = NUM_TRIALS
  width = len(PREFIX) + NUM_TOKENS * (MAX_DEPTH + 1)
  buf = jnp.zeros((b, width), jnp.int32).at[:, :2].set(jnp.asarray(PREFIX))
  count = jnp.full((b,), len(PREFIX), jnp.int32)
  rows = jnp.arange(b)[:, None]
  for step in range(NUM_TOKENS):   # each step commits >= 1 token
    key_tree, key_verify = jax.random.split(jax.random.fold_in(key, step))
    ctx = jnp.stack([buf[jnp.arange(b), count - 2], buf[jnp.arange(b), count - 1]], axis=1)
    tree, p_BNV = _draw_tree(key_tree, ctx, q_table, p_table, kind)
    if greedy:
      n_B, _, out = greedy_tree_verify(tree, jnp.log(p_BNV), MAX_DEPTH)
    else:
      n_B, _, out = rejection_tree_verify(key_verify, tree, p_BNV, lambda x: x, MAX_DEPTH)
    j = jnp.arange(MAX_DEPTH + 1)[None, :]
    pos = jnp.where(j <= n_B[:, None], count[:, None] + j, width)
    buf = buf.at[rows, pos].set(out, mode='drop')
    count = count + n_B + 1
  return buf[:, len(PREFIX):len(PREFIX) + NUM_TOKENS]


SETTINGS = {'T1': (1.0, 1.0), 'T0.7_top_p0.8': (0.7, 0.8)}


@pytest.mark.slow
@pytest.mark.parametrize('setting', list(SETTINGS))
@pytest.mark.parametrize('kind', ['with_replacement', 'without_replacement', 'top_k',
                                  'all_wrong'])
def test_joint_matches_target(kind, setting):
  temperature, top_p = SETTINGS[setting]
  p = _processed(TARGET, temperature, top_p)
  samples = np.asarray(_committed(jax.random.key(len(kind) + 7 * len(setting)),
                                  jnp.asarray(DRAFT, jnp.float32),
                                  jnp.asarray(p, jnp.float32), kind))
  counts = joint_counts(samples, V)
  exact = _exact_joint(p)
  p3 = chi_square_pvalue(counts, exact)
  p2 = chi_square_pvalue(counts.sum(-1), exact.sum(-1))
  assert p2 > ALPHA and p3 > ALPHA, (kind, setting, p2, p3)


def test_trees_are_adversarial():
  """The draft q is concentrated off the target's mode (its top token is the target's
  least likely one in most contexts), and sampled sibling sets hold duplicates."""
  least = np.argmin(TARGET, axis=-1)
  assert np.mean(np.argmax(DRAFT, axis=-1) == least) > 0.5
  tree, _ = _draw_tree(jax.random.key(0), jnp.asarray([PREFIX] * 64, jnp.int32),
                       jnp.asarray(DRAFT, jnp.float32),
                       jnp.asarray(TARGET, jnp.float32), 'with_replacement')
  first = np.asarray(tree.tokens_BN[:, 1:4])
  assert np.any((first[:, 0] == first[:, 1]) | (first[:, 1] == first[:, 2]))


@pytest.mark.slow
def test_greedy_commits_the_argmax_chain():
  """T = 0: whatever the tree, the committed tokens are the target's argmax chain."""
  got = np.asarray(_committed(jax.random.key(3), jnp.asarray(DRAFT, jnp.float32),
                              jnp.asarray(TARGET, jnp.float32), 'with_replacement',
                              greedy=True))
  want = list(PREFIX)
  for _ in range(NUM_TOKENS):
    want.append(int(np.argmax(TARGET[want[-2], want[-1]])))
  np.testing.assert_array_equal(got, np.broadcast_to(want[2:], got.shape))
