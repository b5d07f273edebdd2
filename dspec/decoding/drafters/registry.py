"""Builds the drafter a decode config asks for (`cfg.drafter` + `cfg.drafters.<name>`).

Every builder has one signature, `build(cfg, target) -> (drafter, params)`; adding a
drafter adds one line to `_BUILDERS` and its defaults to `DEFAULTS` (see
`dspec/decoding/drafter.py`).
"""

from __future__ import annotations

import importlib
import sys

from dspec import checkpoint
from dspec.decoding.drafter import NoDrafter

# drafter name -> module in dspec.decoding.drafters whose `build(cfg, target)` makes it
_BUILDERS = {
    'ngram': 'ngram',
    'suffix': 'suffix',
    'oracle': 'oracle',
    'self': 'self_draft',
    'mtp': 'mtp',
    'dflash': 'dflash',
    'dspark': 'dspark',
    'eagle3': 'eagle3',
    'grammar': 'forced',
}

# Config defaults of every drafter (`cfg.drafters.<name>`). `num_draft` is each one's
# draft length γ; for learned drafters 0 means what the checkpoint was trained for (MTP:
# every depth; DFlash: the trained block - 1; DSpark: the trained block; EAGLE-3: its
# ttt_steps).
DEFAULTS = {
    'ngram': {'num_draft': 8, 'min_n': 1, 'max_n': 4},
    'suffix': {'num_draft': 16, 'max_depth': 32, 'min_token_prob': 0.1,
               'max_spec_factor': 1.0, 'max_spec_offset': 0.0, 'max_cached_requests': 1000},
    'oracle': {'num_draft': 8, 'acceptance': [0.8]},
    'self': {'num_draft': 4},
    'mtp': {'path': '', 'num_draft': 0, 'sample_proposals': False, 'token_map': ''},
    'dflash': {'path': '', 'num_draft': 0, 'denoise_steps': 1, 'shrink_block': False,
               'attention_impl': 'xla'},
    'dspark': {'path': '', 'num_draft': 0, 'verify_cost': 0.1, 'verify_budget': 0,
               'shrink_block': False, 'attention_impl': 'xla'},
    'eagle3': {'path': '', 'num_draft': 0, 'sample_proposals': True},
    'grammar': {'num_draft': 16},   # structured output only: the tokens it forces
}

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
