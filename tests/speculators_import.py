"""speculators' model definitions for parity tests, without its training stack.

`import speculators` pulls in `speculators.train.data`, which needs packages the parity
tests do not (openai, ...); the models import one name from it (BatchType), so a stub
module stands in for it. Skips the test when torch or speculators is missing.
"""

import importlib
import sys
import types

import pytest


def speculators_module(name: str):
  """`speculators.<name>` (e.g. 'models.mtp'), importable without the training stack."""
  pytest.importorskip('torch')
  if 'speculators.train.data' not in sys.modules:
    stub = types.ModuleType('speculators.train.data')
    stub.BatchType = dict
    sys.modules['speculators.train.data'] = stub
  pytest.importorskip('speculators')
  return importlib.import_module(f'speculators.{name}')
