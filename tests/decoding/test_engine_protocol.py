"""Every engine the one builder makes implements the `Engine` protocol."""

import pytest

from dspec.decoding import runner
from dspec.decoding.drafters.ngram import NgramDrafter
from dspec.decoding.drafters.suffix import SuffixDrafter
from dspec.decoding.engine import Engine


@pytest.mark.parametrize('drafter, verify_length', [
    (None, 'fixed'), (NgramDrafter(num_draft=4), 'fixed'), (NgramDrafter(num_draft=4), 'auto'),
    (NgramDrafter(num_draft=4), 'tree'), (NgramDrafter(num_draft=4), 'auto_tree'),
    (SuffixDrafter(num_draft=4), 'fixed'), (SuffixDrafter(num_draft=4), 'auto'),
], ids=['ar', 'chain', 'controller', 'tree', 'auto_tree', 'host', 'host_controller'])
def test_every_engine_implements_the_protocol(tiny_split, drafter, verify_length):
  engine = runner.speculative_engine(tiny_split[0], drafter, verify_length=verify_length)
  assert isinstance(engine, Engine)
  assert engine.adaptive == verify_length.startswith('auto')
  assert engine.num_draft == (drafter.num_draft if drafter else 0)
  if engine.adaptive:   # the controller's tiers are engines too
    assert all(isinstance(e, Engine) for e in engine.engines.values())
