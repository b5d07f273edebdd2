"""A step whose drafter proposes nothing verifies the anchor alone: an AR step's cost."""

import numpy as np
import pytest

from conftest import generate
from dspec.decoding.drafters.suffix import SuffixDrafter
from dspec.decoding.engine import SpeculativeEngine
from dspec.decoding.prompts import pad_prompts
from dspec.sampling import SamplingSpec

PROMPTS = [[5, 6, 7, 8, 9, 10], [1, 2], [33, 4, 12]]


@pytest.mark.parametrize('temperature', [0.0, pytest.param(1.0, marks=pytest.mark.slow)])
def test_empty_proposals_verify_the_anchor_alone(tiny_split, temperature):
  graphdef, params = tiny_split
  spec = SamplingSpec.create(temperature, 0, 1.0)
  kw = dict(temperature=temperature, seed=1)
  ar_ids, _ = generate(SpeculativeEngine(graphdef, sampling=spec), params, None, PROMPTS,
                       12, **kw)
  # A host drafter's device side: γ = 4 slots, never a proposal.
  empty = SpeculativeEngine(graphdef, drafter=SuffixDrafter(num_draft=4), sampling=spec)
  ids, state = generate(empty, params, None, PROMPTS, 12, **kw)
  assert ids == ar_ids
  assert not np.any(np.asarray(state.stats.proposed_B))
  # A 5-wide verify would have written K/V for the 4 empty slots past each anchor; the
  # anchor-only forward leaves every cache position past the last anchor untouched.
  k = np.asarray(state.cache.k_LBSKD)
  lengths = np.asarray(state.cache.lengths_B)
  width = pad_prompts(PROMPTS)[0].shape[1]
  for b in range(len(PROMPTS)):
    assert np.all(k[:, b, max(width, lengths[b] + 1):] == 0), b
    assert np.any(k[:, b, lengths[b] - 1] != 0)
