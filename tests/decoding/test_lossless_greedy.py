"""Greedy losslessness: speculative output == AR output, token for token, for every drafter.

Several prompts (ragged), batch 1 and batch > 1, draft lengths 1..16. New drafters are
added to DRAFTERS below.
"""

import numpy as np
import pytest

from conftest import generate
from dspec.decoding.drafters.ngram import NgramDrafter
from dspec.decoding.drafters.oracle import OracleDrafter
from dspec.decoding.drafters.self_draft import SelfDrafter
from dspec.decoding.engine import SpeculativeEngine
from dspec.metrics import acceptance_metrics

# Repetitive prompts so n-gram drafts are sometimes right, sometimes wrong.
PROMPTS = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [9, 9, 1], [7, 20, 31, 7, 20, 31, 7, 44, 2, 7, 20]]
NEW_TOKENS = 24

DRAFTERS = [
    *[('ngram', NgramDrafter(num_draft=g, min_n=1, max_n=3)) for g in (1, 2, 3, 5, 8, 16)],
    *[('oracle', OracleDrafter(num_draft=g, acceptance=(0.9, 0.6)))
      for g in (1, 4, 16)],
    *[('self', SelfDrafter(num_draft=g)) for g in (1, 4)],
]


@pytest.fixture(scope='module')
def ar_outputs(tiny_split):
  engine = SpeculativeEngine(tiny_split[0])
  batched, state = generate(engine, tiny_split[1], None, PROMPTS, NEW_TOKENS)
  single = [generate(engine, tiny_split[1], None, [p], NEW_TOKENS)[0][0] for p in PROMPTS]
  return batched, single


@pytest.mark.slow
@pytest.mark.parametrize('name,drafter', DRAFTERS,
                         ids=[f'{n}-g{d.num_draft}' for n, d in DRAFTERS])
def test_greedy_speculative_equals_ar(tiny_split, ar_outputs, name, drafter):
  batched_ref, single_ref = ar_outputs
  engine = SpeculativeEngine(tiny_split[0], drafter=drafter)
  outs, state = generate(engine, tiny_split[1], None, PROMPTS, NEW_TOKENS)
  assert outs == batched_ref
  assert generate(engine, tiny_split[1], None, [PROMPTS[0]], NEW_TOKENS)[0][0] == \
      single_ref[0]
  accepted = int(np.asarray(state.stats.accepted_B).sum())
  assert accepted > 0, 'test prompts should exercise acceptance'
  if name == 'self':
    assert accepted == int(np.asarray(state.stats.proposed_B).sum())


def test_per_position_counters_follow_the_trace(tiny_split):
  """reached/passed per draft position equal a recount from row 0's per-step trace, where
  the n-gram drafter's proposal length varies from step to step."""
  engine = SpeculativeEngine(tiny_split[0], drafter=NgramDrafter(num_draft=5, min_n=1,
                                                                 max_n=3), trace=True)
  _, state = generate(engine, tiny_split[1], None, PROMPTS, NEW_TOKENS)
  steps = int(state.stats.steps_B[0])
  proposed = np.asarray(state.trace.num_proposed_S)[:steps]
  accepted = np.asarray(state.trace.num_accepted_S)[:steps]
  assert len(set(proposed.tolist())) > 1, 'the test needs varying proposal lengths'
  k = np.arange(1, 6)[None, :]
  reached = ((k <= proposed[:, None]) & (k <= accepted[:, None] + 1)).sum(0)
  passed = ((k <= proposed[:, None]) & (k <= accepted[:, None])).sum(0)
  np.testing.assert_array_equal(np.asarray(state.stats.reached_BG)[0], reached)
  np.testing.assert_array_equal(np.asarray(state.stats.passed_BG)[0], passed)
  np.testing.assert_array_equal(np.asarray(state.stats.passed_BG).sum(1),
                                np.asarray(state.stats.accepted_B))
  committed = int(state.stats.committed_B[0])
  assert acceptance_metrics(state.stats, rows=[0])['verified_per_committed'] == \
      pytest.approx((steps + proposed.sum()) / committed)
