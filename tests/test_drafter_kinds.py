"""Every drafter kind registers once (`dspec.drafter_kinds.KINDS`): each registration has
every part its kind needs, in the package of the layer that uses it, and every per-kind
table (drafter builders and defaults, checkpoint formats, training tasks, slot readers) is
derived from the registrations, so a kind added to one table only fails here."""

import importlib
import inspect
import os
import pkgutil

import dspec.models
from conftest import REPO_ROOT
from dspec.decoding.drafters import registry
from dspec.drafter_kinds import BY_NAME, KINDS, resolve
from dspec.models.formats import DRAFTERS
from dspec.training import slot_acceptance, tasks

LEARNED = sorted(kind.name for kind in KINDS if kind.learned)


def test_names_and_tasks_are_unique():
  assert len(BY_NAME) == len(KINDS)
  drafter_tasks = [task for kind in KINDS for task in kind.tasks]
  assert len(set(drafter_tasks)) == len(drafter_tasks)
  assert not set(drafter_tasks) & set(tasks._TARGET_TASKS)


def test_every_registration_has_its_parts():
  for kind in KINDS:
    if kind.drafter:
      module = importlib.import_module(f'dspec.decoding.drafters.{kind.drafter}')
      assert callable(module.build), kind.name
      assert 'num_draft' in kind.defaults, kind.name
    else:   # a checkpoint kind another drafter decodes
      assert kind.defaults is None and kind.learned, kind.name
    parts = (kind.writers, kind.tasks, kind.slots)
    if not kind.learned:
      assert not any(parts) and kind.backbone is None, kind.name
      continue
    assert all(parts), f'{kind.name}: a learned kind needs writers, tasks and slots'
    for name in (kind.load, *kind.writers.values()):
      assert callable(resolve(name, 'dspec.models.formats')), (kind.name, name)
    for name in kind.tasks.values():
      assert callable(resolve(name, 'dspec.training')), (kind.name, name)
    assert isinstance(resolve(kind.slots, 'dspec.training'), slot_acceptance.SlotReader)
    assert kind.backbone is None or BY_NAME[kind.backbone].learned, kind.name


def test_every_table_derives_from_the_registrations():
  decoding = [kind for kind in KINDS if kind.drafter]
  assert registry.DEFAULTS == {kind.name: kind.defaults for kind in decoding}
  assert registry.known() == sorted(['none', *(kind.name for kind in decoding)])
  assert sorted(DRAFTERS) == LEARNED
  for name in LEARNED:
    kind = BY_NAME[name]
    assert DRAFTERS[name].load is resolve(kind.load, 'dspec.models.formats')
    assert DRAFTERS[name].writers == {form: resolve(save, 'dspec.models.formats')
                                      for form, save in kind.writers.items()}
  assert tasks.DRAFTER_KINDS == {task: kind.name for kind in KINDS for task in kind.tasks}
  assert tasks.BACKBONE_KINDS == {kind.name: kind.backbone for kind in KINDS
                                  if kind.backbone}
  assert set(tasks._builders()) == set(tasks.DRAFTER_KINDS) | set(tasks._TARGET_TASKS)
  assert list(slot_acceptance.KINDS) == LEARNED


def test_every_drafter_model_is_a_registered_kind():
  """A drafter model's `checkpoint_kind` names its registration (`slot_acceptance.kind_of`
  and the checkpoint loads read it)."""
  kinds = set()
  for info in pkgutil.iter_modules(dspec.models.__path__):
    module = importlib.import_module(f'dspec.models.{info.name}')
    kinds |= {cls.checkpoint_kind for cls in vars(module).values()
              if inspect.isclass(cls) and 'checkpoint_kind' in vars(cls)}
  assert sorted(kinds) == LEARNED


def test_the_recipes_name_the_registration():
  for rel in ('docs/DESIGN.md', 'dspec/decoding/drafter.py'):
    with open(os.path.join(REPO_ROOT, rel), encoding='utf-8') as f:
      assert '`dspec/drafter_kinds.py`' in f.read(), rel
