"""Continuous batching: refilled rows give the same tokens as static batches."""

import pytest

from dspec.decoding.batching import serve, static_batches
from dspec.decoding.drafters.ngram import NgramDrafter
from dspec.decoding.engine import SpeculativeEngine
from dspec.decoding.runner import speculative_engine

REQUESTS = [[3, 4, 5, 6, 3, 4], [9, 9, 1], [7, 20, 31, 7, 20], [1, 2], [33, 4, 12, 8],
            [5, 6, 7, 8, 9, 10]]


@pytest.mark.slow
def test_refilled_rows_match_static_batches(tiny_split):
  plain = SpeculativeEngine(tiny_split[0])
  ref = static_batches(plain, tiny_split[1], None, REQUESTS, 3, max_new_tokens=12)
  stop = ref[0][4]     # a stop token makes rows finish at different steps
  engine = SpeculativeEngine(tiny_split[0], stop_ids=(stop,),
                             drafter=NgramDrafter(num_draft=3, max_n=3))
  out = serve(engine, tiny_split[1], None, REQUESTS, 2, max_new_tokens=12)
  want = [r[:r.index(stop) + 1] if stop in r else r for r in ref]
  assert out['outputs'] == want
  assert out['live_row_steps'] <= out['row_steps']
  assert sum(out['steps']) == out['live_row_steps']


@pytest.mark.slow
def test_serve_under_the_controller_refills_between_chunks(tiny_split):
  """`serve` with `verify_length='auto'` (the controller picks each chunk's verify
  length; rows refilled between chunks): every request's tokens are AR's."""
  plain = SpeculativeEngine(tiny_split[0])
  ref = static_batches(plain, tiny_split[1], None, REQUESTS, 3, max_new_tokens=12)
  stop = ref[0][4]
  controller = speculative_engine(tiny_split[0], NgramDrafter(num_draft=3, max_n=3),
                                  stop_ids=(stop,), verify_length='auto')
  assert controller.adaptive
  out = serve(controller, tiny_split[1], None, REQUESTS, 2, max_new_tokens=12)
  assert out['outputs'] == [r[:r.index(stop) + 1] if stop in r else r for r in ref]
  assert sum(out['steps']) == out['live_row_steps'] <= out['row_steps']
  assert sum(controller.tier_steps().values()) > 0


def test_undeclared_state_leaf_cannot_be_refilled():
  import jax.numpy as jnp
  from dspec.decoding.batching import _insert_row
  with pytest.raises(ValueError, match='no declared logical axes'):
    _insert_row({'mystery': jnp.zeros((2, 3))}, {'mystery': jnp.zeros((1, 3))}, 0)
