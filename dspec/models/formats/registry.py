"""The learned drafter kinds and their directory forms: how each kind loads (any form it
reads, `drafter_dir.detect`) and which published forms dspec writes it in (both from its
registration in `dspec.drafter_kinds`)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from dspec import checkpoint
from dspec.drafter_kinds import KINDS, resolve
from dspec.models.formats.drafter_dir import ZLAB_ARCHITECTURES, form_of, read_config


@dataclasses.dataclass(frozen=True)
class DrafterFormats:
  """load(path, *, target_cfg=None, **options) -> model, from any form the kind reads;
  writers: published form -> save(path, model, *, dtype, force), the first one the
  default."""

  load: Callable
  writers: Mapping[str, Callable]


_PACKAGE = 'dspec.models.formats'
DRAFTERS = {kind.name: DrafterFormats(resolve(kind.load, _PACKAGE),
                                      {form: resolve(save, _PACKAGE)
                                       for form, save in kind.writers.items()})
            for kind in sorted(KINDS, key=lambda k: k.name) if kind.learned}
# The kind of every directory in a form that holds one kind only.
_FORM_KINDS = {'deepseek': 'mtp', 'legacy': 'eagle3'}


def kind_of(path) -> str:
  """The kind of model in a directory: a dspec checkpoint's metadata kind ('target',
  'dflash', ...), speculators' `speculators_model_type`, a z-lab architecture's kind, or
  the one kind of a DeepSeek-V3 (mtp) or legacy (eagle3) directory."""
  config = read_config(path)
  form = form_of(config)
  if form == 'dspec':
    return checkpoint.read_model_kind(path)
  if form == 'speculators':
    return config['speculators_model_type']
  if form == 'zlab':
    return next(ZLAB_ARCHITECTURES[a] for a in config['architectures']
                if a in ZLAB_ARCHITECTURES)
  return _FORM_KINDS[form]
