"""Every drafter kind, registered once: the drafter registry, the checkpoint formats, the
training tasks and the slot-acceptance tables all derive their entries from `KINDS`.

The parts are 'module:attr' names, each imported only by the layer that uses it, inside
the package of that layer (so this table imports nothing and sits below them all):
`drafter` in dspec.decoding.drafters, `load` / `writers` in dspec.models.formats, `tasks`
/ `slots` in dspec.training.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Mapping, Optional


@dataclasses.dataclass(frozen=True)
class DrafterKind:
  """One drafter kind.

  name: `cfg.drafter` and `cfg.drafters.<name>` when it decodes; for a learned kind also
    its checkpoint kind (`checkpoint_kind` of its model class).
  drafter: the module whose `build(cfg, target) -> (drafter, params)` makes it; None for a
    checkpoint kind another drafter decodes (DFlash-2: dflash).
  defaults: its `cfg.drafters.<name>` config, with `num_draft` (γ; 0 for a learned kind:
    what the checkpoint was trained for, `SlotReader.num_slots`).
  load: `load(path, *, target_cfg=None, **options) -> model` from any form the kind reads.
  writers: published form -> `save(path, model, *, dtype, force)`, the first the default.
  tasks: `training.task` -> `build_task(cfg, workdir)` of a task that trains and exports
    this kind (its `init_from` is an export of this kind, or of `backbone`).
  backbone: the kind whose export a new drafter of this kind may start from (its own heads
    fresh).
  slots: its `slot_acceptance.SlotReader` (teacher-forced per-slot acceptance).
  """

  name: str
  drafter: Optional[str] = None
  defaults: Optional[Mapping] = None
  load: Optional[str] = None
  writers: Mapping[str, str] = dataclasses.field(default_factory=dict)
  tasks: Mapping[str, str] = dataclasses.field(default_factory=dict)
  backbone: Optional[str] = None
  slots: Optional[str] = None

  @property
  def learned(self) -> bool:
    return self.load is not None


# One registration per kind (`cfg.drafters` keeps this order).
KINDS = (
    DrafterKind('ngram', 'ngram', {'num_draft': 8, 'min_n': 1, 'max_n': 4}),
    DrafterKind('suffix', 'suffix', {'num_draft': 16, 'max_depth': 32, 'min_token_prob': 0.1,
                                     'max_spec_factor': 1.0, 'max_spec_offset': 0.0,
                                     'max_cached_requests': 1000}),
    DrafterKind('oracle', 'oracle', {'num_draft': 8, 'acceptance': [0.8]}),
    DrafterKind('self', 'self_draft', {'num_draft': 4}),
    DrafterKind('mtp', 'mtp', {'path': '', 'num_draft': 0, 'sample_proposals': False,
                               'token_map': ''},
                load='mtp:load_mtp', writers={'speculators': 'mtp:save_speculators'},
                tasks={'mtp_posthoc': 'mtp_task:build_posthoc_task'},
                slots='slot_acceptance:MTP_SLOTS'),
    DrafterKind('dflash', 'dflash', {'path': '', 'num_draft': 0, 'denoise_steps': 1,
                                     'shrink_block': False, 'attention_impl': 'xla'},
                load='dflash:load_dflash', writers={'zlab': 'dflash:save_zlab'},
                tasks={'dflash': 'dflash_task:build_task', 'bd3lm': 'dflash_task:build_task'},
                slots='slot_acceptance:DFLASH_SLOTS'),
    DrafterKind('dflash2', load='dflash:load_dflash', writers={'zlab': 'dflash:save_zlab'},
                tasks={'dflash2': 'dflash_task:build_task'}, backbone='dflash',
                slots='slot_acceptance:DFLASH2_SLOTS'),
    DrafterKind('dspark', 'dspark', {'path': '', 'num_draft': 0, 'verify_cost': 0.1,
                                     'verify_budget': 0, 'shrink_block': False,
                                     'attention_impl': 'xla'},
                load='dspark:load_dspark', writers={'speculators': 'dspark:save_speculators'},
                tasks={'dspark': 'dspark_task:build_task'}, backbone='dflash',
                slots='slot_acceptance:DSPARK_SLOTS'),
    DrafterKind('eagle3', 'eagle3', {'path': '', 'num_draft': 0, 'sample_proposals': True},
                load='eagle3:load_eagle3', writers={'speculators': 'eagle3:save_speculators'},
                tasks={'eagle3': 'eagle3_task:build_task'}, slots='slot_acceptance:EAGLE3_SLOTS'),
    DrafterKind('grammar', 'forced', {'num_draft': 16}),   # structured output: forced tokens
)
BY_NAME = {kind.name: kind for kind in KINDS}


def resolve(name: str, package: str):
  """The object a 'module:attr' part names, its module in `package` (imported now)."""
  module, _, attr = name.partition(':')
  return getattr(importlib.import_module(f'{package}.{module}'), attr)
