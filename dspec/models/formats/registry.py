"""The drafter kinds and their directory forms: how each kind loads (any form it reads,
`drafter_dir.detect`) and which published forms dspec writes it in."""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from dspec import checkpoint
from dspec.models.formats import dflash, dspark, eagle3, mtp
from dspec.models.formats.drafter_dir import ZLAB_ARCHITECTURES, form_of, read_config


@dataclasses.dataclass(frozen=True)
class DrafterFormats:
  """load(path, **options) -> model, from any form the kind reads; writers: published
  form -> save(path, model, *, dtype, force), the first one the default."""

  load: Callable
  writers: Mapping[str, Callable]


DRAFTERS = {
    'dflash': DrafterFormats(dflash.load_dflash, {'zlab': dflash.save_zlab}),
    'dflash2': DrafterFormats(dflash.load_dflash, {'zlab': dflash.save_zlab}),
    'dspark': DrafterFormats(dspark.load_dspark, {'speculators': dspark.save_speculators}),
    'eagle3': DrafterFormats(eagle3.load_eagle3, {'speculators': eagle3.save_speculators}),
    'mtp': DrafterFormats(mtp.load_mtp, {'speculators': mtp.save_speculators}),
}
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
