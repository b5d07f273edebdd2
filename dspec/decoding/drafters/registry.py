"""Builds the drafter a decode config asks for (`cfg.drafter` + `cfg.drafters.<name>`).

Every builder has one signature, `build(cfg, target) -> (drafter, params)`; the builders
and their config defaults are the decoding kinds of `dspec.drafter_kinds.KINDS` (see
`dspec/decoding/drafter.py`).
"""

from __future__ import annotations

import importlib
import sys

from dspec import checkpoint
from dspec.decoding.drafter import NoDrafter
from dspec.drafter_kinds import KINDS

# drafter name -> module in dspec.decoding.drafters whose `build(cfg, target)` makes it
_BUILDERS = {kind.name: kind.drafter for kind in KINDS if kind.drafter}
# Config defaults of every drafter (`cfg.drafters.<name>`, each with `num_draft`).
DEFAULTS = {kind.name: kind.defaults for kind in KINDS if kind.drafter}


def known() -> list:
  return sorted(['none', *_BUILDERS])


def name_of(drafter) -> str:
  """The registry name of a built drafter ('ar' for none)."""
  drafter = getattr(drafter, 'inner', drafter)   # a controller tier wraps its drafter
  if isinstance(drafter, NoDrafter):
    return 'ar'
  module = type(drafter).__module__.rpartition('.')[2]
  names = [name for name, mod in _BUILDERS.items() if mod == module]
  return names[0] if names else type(drafter).__name__


def build_drafter(cfg, target):
  """(drafter, drafter_params), checked against the target; ValueError naming the known
  drafters for a bad name."""
  name = cfg.drafter
  if name == 'none':
    return NoDrafter(), None
  if name not in _BUILDERS:
    raise ValueError(f'unknown drafter {name!r}; known: {", ".join(known())}')
  module = importlib.import_module(f'dspec.decoding.drafters.{_BUILDERS[name]}')
  drafter, params = module.build(cfg, target)
  drafter.check_target(target.cfg)
  path = cfg.drafters[name].get('path', '')
  mismatch = path and checkpoint.check_target_record(path, target)
  if mismatch:
    print(f'warning: {mismatch}', file=sys.stderr, flush=True)
  return drafter, params
