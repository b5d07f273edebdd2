"""Orbax checkpoints: model weights with JSON metadata, and resumable training state.

A checkpoint written by `save_tree` is one directory holding two orbax items:

  PATH/state/      the array pytree (PyTree handler, OCDBT)
  PATH/metadata/   a JSON object (kind, config, ...)

Orbax writes both into a temporary sibling directory and renames it to PATH only once every
file is complete, so an interrupted save leaves no PATH (only a `*.orbax-checkpoint-tmp*`
folder, which `load_tree` refuses). `TrainCheckpointer` keeps numbered steps of the same
two items under one directory for resumable training.

Every save records a SHA-256 of each array (dtype, shape and bytes) in the metadata
(`array_sha256`); loads recompute them and name the first array that does not match.
Checkpoints from before checksums load as "unverified" (with a warning). Replacing an
existing checkpoint (`force=True`) only ever replaces a dspec checkpoint directory, and
the old one is removed only once the new one is complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from dspec import files
from dspec.config_checks import check_stored_config
from dspec.errors import CheckpointError, UserError
from dspec.pytrees import key_name

FORMAT_VERSION = 1
STORAGE_DTYPES = ('float32', 'bfloat16')
_STATE_ITEM = 'state'
_METADATA_ITEM = 'metadata'
_TMP_MARKER = '.orbax-checkpoint-tmp'
_COMMIT_MARKER = 'commit_success.txt'
_CHECKSUMS = 'array_sha256'
# What a checkpoint directory may hold: orbax's items and markers, and tokenizer files that
# exports and `convert_hf.py` copy next to the weights. `force=True` replaces nothing else.
_CHECKPOINT_ENTRIES = frozenset({
    _STATE_ITEM, _METADATA_ITEM, '_CHECKPOINT_METADATA', _COMMIT_MARKER,
    'tokenizer.json', 'tokenizer_config.json', 'generation_config.json',
    'special_tokens_map.json'})
_unverified_warned = set()


def _first_line(err: BaseException) -> str:
  text = str(err).strip().splitlines()
  line = text[0] if text else type(err).__name__
  return line if len(line) <= 300 else line[:297] + '...'


def _as_path(path) -> epath.Path:
  """Absolute path (orbax needs one); URLs such as gs://... are kept as they are."""
  path = os.fspath(path)
  return epath.Path(path if '://' in path else os.path.abspath(path))


def leaf_paths(tree) -> dict[str, Any]:
  """Flattens a pytree to {'a.b.0.c': leaf}; dict keys, attributes and indices alike."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {'.'.join(key_name(k) for k in path): leaf for path, leaf in flat}


def _shape(leaf) -> tuple:
  return tuple(leaf.shape) if hasattr(leaf, 'shape') else np.shape(leaf)


def _addressable(leaf) -> bool:
  return getattr(leaf, 'is_fully_addressable', True)


def array_sha256(leaf) -> str:
  """SHA-256 of one array's dtype, shape and bytes (device arrays are fetched first)."""
  a = np.ascontiguousarray(np.asarray(jax.device_get(leaf)))
  digest = hashlib.sha256(f'{a.dtype.name}{a.shape}'.encode())
  digest.update(a.reshape(-1).view(np.uint8))
  return digest.hexdigest()


def tree_checksums(tree) -> dict[str, str]:
  """{leaf path: array_sha256} of every leaf this process can read in full."""
  return {name: array_sha256(leaf) for name, leaf in leaf_paths(tree).items()
          if _addressable(leaf)}


def params_sha256(tree) -> str:
  """One SHA-256 over every leaf of `tree` (names, dtypes, shapes, bytes): a weights
  fingerprint."""
  digest = hashlib.sha256()
  for name, value in sorted(tree_checksums(tree).items()):
    digest.update(f'{name}={value};'.encode())
  return digest.hexdigest()


def weights_fingerprint(model: nnx.Module, sample: int = 4096) -> str:
  """A fingerprint of a module's parameters that is cheap at any size: SHA-256 over each
  leaf's name, shape and up to `sample` evenly strided values cast to float32 (so weights
  held in float32 or bfloat16 agree: bf16 -> f32 is exact)."""
  digest = hashlib.sha256()
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  for name, leaf in sorted(leaf_paths(params).items()):
    flat = np.asarray(jax.device_get(leaf)).reshape(-1)
    values = np.ascontiguousarray(flat[::max(1, flat.size // sample)].astype(np.float32))
    digest.update(f'{name}{tuple(np.shape(leaf))}'.encode())
    digest.update(values.view(np.uint8))
  return digest.hexdigest()


def target_fingerprint(target: nnx.Module) -> str:
  """The fingerprint drafter checkpoints record of their target (`extra.target_sha256`):
  its `weights_fingerprint`, except that a target widened by `models/widen.py` (the same
  function, hence the same tokens) gives the one of the model it was widened from."""
  return getattr(target, 'widened_from', None) or weights_fingerprint(target)


def target_record(target: nnx.Module, model_cfg) -> dict:
  """What a drafter checkpoint records of the target it was trained against (its
  `extra`): the target's fingerprint and where the target came from."""
  return {'target_sha256': target_fingerprint(target),
          'target_source': f'{model_cfg.source}:{model_cfg.path}' if model_cfg.path
                           else model_cfg.source}


def check_target_record(path, target: nnx.Module) -> Optional[str]:
  """A warning naming both targets when the dspec checkpoint at `path` records a target
  other than `target`; None when it matches or records none (published formats)."""
  try:
    extra = _read_metadata(_as_path(path)).get('extra') or {}
  except (CheckpointError, OSError, ValueError):
    return None
  recorded = extra.get('target_sha256')
  if not recorded:
    return None
  actual = target_fingerprint(target)
  if recorded == actual:
    return None
  return (f'{path} was trained against the target {extra.get("target_source", "?")} '
          f'(weights {recorded[:12]}), not this one (weights {actual[:12]}): it decodes '
          f'losslessly but its drafts may rarely be accepted')


def _split_checksums(metadata: dict) -> tuple[dict, Optional[dict]]:
  """(metadata without the checksums, the checksums or None when it has none)."""
  metadata = dict(metadata)
  checksums = metadata.pop(_CHECKSUMS, None)
  return metadata, checksums if isinstance(checksums, dict) else None


def _verify(where, tree, checksums: Optional[dict], stored_tree) -> None:
  """Raises CheckpointError naming the first restored array whose checksum differs.

  Arrays restored in a dtype other than the stored one cannot be compared and are skipped;
  checkpoints without checksums are reported once as unverified.
  """
  if checksums is None:
    if str(where) not in _unverified_warned:
      _unverified_warned.add(str(where))
      logging.getLogger('dspec').warning(
          '%s: no array checksums (saved by an older dspec); contents not verified', where)
    return
  stored = leaf_paths(stored_tree)
  for name, leaf in leaf_paths(tree).items():
    want = checksums.get(name)
    if want is None or not _addressable(leaf):
      continue
    stored_dtype = getattr(stored.get(name), 'dtype', None)
    if stored_dtype is not None and np.dtype(stored_dtype) != np.dtype(leaf.dtype):
      continue
    if array_sha256(leaf) != want:
      raise CheckpointError(f'{where}: array {name!r} does not match its checksum: the '
                            'checkpoint is corrupt')


def _check_against(path, stored_tree, abstract_tree) -> None:
  """Raises CheckpointError at the first leaf whose presence or shape differs."""
  stored = leaf_paths(stored_tree)
  wanted = leaf_paths(abstract_tree)
  for name, leaf in wanted.items():
    if name not in stored:
      raise CheckpointError(f'{path}: leaf {name!r} (shape {_shape(leaf)}) is not in '
                            'the checkpoint')
    if _shape(stored[name]) != _shape(leaf):
      raise CheckpointError(
          f'{path}: leaf {name!r} has shape {_shape(stored[name])} in the checkpoint '
          f'but {_shape(leaf)} is expected')
  extra = sorted(set(stored) - set(wanted))
  if extra:
    raise CheckpointError(f'{path}: checkpoint has leaf {extra[0]!r} that the expected tree '
                          f'lacks ({len(extra)} extra leaves)')


def _item_handlers() -> dict:
  return {_STATE_ITEM: ocp.PyTreeCheckpointHandler(),
          _METADATA_ITEM: ocp.JsonCheckpointHandler()}


class _AbortedReadLogFilter(logging.Filter):
  """Drops asyncio's 'Task exception was never retrieved' records about one checkpoint."""

  def __init__(self, where: str):
    super().__init__()
    self.where = where

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not (str(record.msg).startswith('Task exception was never retrieved')
                and exc is not None and self.where in str(exc))


def _silence_aborted_reads(where) -> None:
  """Mutes the noise orbax leaves behind after a failed read of checkpoint `where`.

  When one tensorstore read fails, orbax closes its asyncio loop while sibling reads are in
  flight: their callbacks raise 'Event loop is closed' into `sys.unraisablehook`, and their
  unretrieved task errors reach the `asyncio` logger, long after our one-line error. Only
  exactly those are filtered; everything else passes through.
  """
  logging.getLogger('asyncio').addFilter(_AbortedReadLogFilter(str(where)))
  previous = sys.unraisablehook
  if getattr(previous, 'dspec_filter', False):
    return

  def hook(unraisable):
    if not (isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == 'Event loop is closed'):
      previous(unraisable)

  hook.dspec_filter = True
  sys.unraisablehook = hook


def _corrupt(where, err: BaseException) -> CheckpointError:
  _silence_aborted_reads(where)
  return CheckpointError(f'{where}: corrupt or incomplete checkpoint ({_first_line(err)})')


def _stored_tree(where, step_metadata_fn):
  """The saved array-metadata tree (shapes, dtypes) of the `state` item."""
  try:
    item = step_metadata_fn().item_metadata[_STATE_ITEM]
  except Exception as e:  # orbax/tensorstore raise many types; report them all alike.
    raise _corrupt(where, e) from e
  if item is None:
    raise CheckpointError(f'{where}: corrupt or incomplete checkpoint (no array index in '
                          f'{_STATE_ITEM}/)')
  return item.tree


def _checkpointer() -> ocp.Checkpointer:
  return ocp.Checkpointer(ocp.CompositeCheckpointHandler(**_item_handlers()))


def _numpy_restore_args(tree):
  return jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)


def _check_complete(path: epath.Path) -> None:
  if _TMP_MARKER in path.name:
    raise CheckpointError(f'{path}: this is an unfinished (interrupted) save, not a checkpoint')
  if not path.exists():
    raise CheckpointError(f'{path}: no checkpoint here (the directory does not exist)')
  if not path.is_dir():
    raise CheckpointError(f'{path}: not a checkpoint directory')
  for item in (_STATE_ITEM, _METADATA_ITEM):
    if not (path / item).is_dir():
      raise CheckpointError(f'{path}: incomplete checkpoint (no {item}/ inside)')


def _read_metadata(path: epath.Path) -> dict:
  """Validates the directory layout and returns the JSON metadata."""
  _check_complete(path)
  try:
    restored = _checkpointer().restore(
        path, args=ocp.args.Composite(**{_METADATA_ITEM: ocp.args.JsonRestore()}))
    metadata = restored[_METADATA_ITEM]
  except Exception as e:  # orbax/json raise many types; report them all alike.
    raise CheckpointError(f'{path}: unreadable checkpoint metadata ({_first_line(e)})') from e
  if not isinstance(metadata, dict):
    raise CheckpointError(f'{path}: checkpoint metadata is not a JSON object')
  return metadata


def _check_output_path(raw) -> None:
  """Refuses an empty path and the root, home or working directory (or an ancestor)."""
  text = os.fspath(raw)
  if not text.strip():
    raise CheckpointError('empty checkpoint path')
  if '://' in text:
    return
  path = os.path.realpath(text)
  cwd = os.path.realpath(os.getcwd())
  protected = {os.path.realpath(os.path.expanduser('~')), os.path.realpath(os.sep)}
  if path in protected or cwd == path or cwd.startswith(path.rstrip(os.sep) + os.sep):
    raise CheckpointError(f'{text}: refusing to write a checkpoint at the root, home or '
                          'working directory (or one of its parents); name a new directory')


def is_checkpoint_dir(path) -> bool:
  """Whether directory `path` holds a dspec checkpoint and nothing else (what `force=True`
  may replace)."""
  try:
    _check_replaceable(_as_path(path))
  except CheckpointError:
    return False
  return True


def _check_replaceable(path: epath.Path) -> None:
  """Raises CheckpointError unless `path` is a dspec checkpoint directory (and nothing more)."""
  if '://' not in str(path) and os.path.islink(path):
    raise CheckpointError(f'{path}: is a symlink; refusing to replace it')
  if not path.is_dir():
    raise CheckpointError(f'{path}: exists and is not a checkpoint directory; refusing to '
                          'replace it')
  names = {p.name for p in path.iterdir()}
  if not {_STATE_ITEM, _METADATA_ITEM} <= names:
    raise CheckpointError(f'{path}: exists and is not a dspec checkpoint directory (no '
                          f'{_STATE_ITEM}/ and {_METADATA_ITEM}/ inside); refusing to replace it')
  others = sorted(names - _CHECKPOINT_ENTRIES)
  if others:
    raise CheckpointError(f'{path}: holds {others[0]!r}, which is not part of a dspec '
                          'checkpoint; refusing to replace the directory')


def save_tree(path, tree, metadata: dict, *, force: bool = False) -> None:
  """Writes a pytree of arrays and a JSON-serialisable `metadata` dict to directory `path`.

  The write is atomic (temporary directory, then rename), and the metadata records each
  array's checksum. An existing `path` is replaced only with `force=True`, and only when it
  is a dspec checkpoint directory: the new checkpoint is written beside it and swapped in
  once complete (`files.write_dir`). Empty and root-like paths are refused. A write that
  fails (disk full, read-only, permission denied) raises `files.WriteError` naming `path`
  and leaves no partial directory, and an existing checkpoint as it was.
  """
  _check_output_path(path)
  path = _as_path(path)
  if _TMP_MARKER in path.name:
    raise CheckpointError(f'{path}: checkpoint names may not contain {_TMP_MARKER!r}')
  exists = path.exists() or ('://' not in str(path) and os.path.islink(path))
  if exists and not force:
    raise CheckpointError(f'{path}: already exists (pass force=True to overwrite)')
  if exists:
    _check_replaceable(path)
  try:
    metadata = dict(metadata, **{_CHECKSUMS: tree_checksums(tree)})
    json.dumps(metadata)
  except TypeError as e:
    raise CheckpointError(f'{path}: metadata is not JSON-serialisable ({e})') from e
  args = ocp.args.Composite(**{_STATE_ITEM: ocp.args.PyTreeSave(tree),
                               _METADATA_ITEM: ocp.args.JsonSave(metadata)})
  with files.writing(path):
    if jax.process_count() > 1 or ('://' in str(path) and not exists):
      _checkpointer().save(path, force=exists, args=args)
    elif '://' not in str(path):
      files.write_dir(path, lambda tmp: _save_fresh(tmp, args), replace=exists)
    else:   # replacing in a bucket: the same swap through epath
      tag = f'{os.getpid()}-{time.time_ns()}'
      fresh = path.parent / f'{path.name}.dspec-new-{tag}'
      old = path.parent / f'{path.name}.dspec-old-{tag}'
      _checkpointer().save(fresh, args=args)
      path.rename(old)
      fresh.rename(path)
      old.rmtree()
  if jax.process_index() == 0:
    _scrub_commit_markers(path)


class _WriteFailureLogFilter(logging.Filter):
  """Drops the traceback orbax logs of a write that failed on an OS error (a full disk, a
  read-only directory): the save raises it as one line naming the checkpoint."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return exc is None or files.io_error_code(exc) is None


def _mute_closed_loop_callbacks():
  """Installs (and returns the previous) sys.unraisablehook minus RuntimeError('Event loop
  is closed'): when a save fails, orbax closes its event loop while tensorstore writes are
  still in flight, and each one's completion callback raises that into the hook (a raw
  traceback around the error line); the save already failed with one error naming the
  checkpoint."""
  previous = sys.unraisablehook

  def hook(unraisable):
    error = unraisable.exc_value
    if not (isinstance(error, RuntimeError) and str(error) == 'Event loop is closed'):
      previous(unraisable)

  sys.unraisablehook = hook
  return previous


def _save_fresh(path: str, args) -> None:
  """Orbax's save into the new directory `path`; when it fails its temporary sibling is
  removed, so no partial checkpoint is left."""
  mute = _WriteFailureLogFilter()
  logging.getLogger('absl').addFilter(mute)
  previous_hook = _mute_closed_loop_callbacks()
  try:
    _checkpointer().save(_as_path(path), args=args)
    sys.unraisablehook = previous_hook   # after a failure, muted: writes may still end
  except BaseException:
    _remove_leftovers(path)
    raise
  finally:
    logging.getLogger('absl').removeFilter(mute)


def _remove_leftovers(path: str, settle_s: float = 0.5, most_s: float = 10.0) -> None:
  """Removes the temporary siblings of a failed save into `path`. Orbax returns at the
  first failed write while others are still in flight, and those can create files there
  after a first removal: removed again until none has appeared for `settle_s` (at most
  `most_s`)."""
  parent, pattern = epath.Path(path).parent, f'{os.path.basename(path)}{_TMP_MARKER}*'
  start = quiet = time.monotonic()
  while time.monotonic() - quiet < settle_s and time.monotonic() - start < most_s:
    for leftover in parent.glob(pattern):
      quiet = time.monotonic()
      shutil.rmtree(leftover, ignore_errors=True)
    time.sleep(0.05)


def _scrub_commit_markers(path) -> None:
  """Orbax's `commit_success.txt` markers name the absolute directory they were written
  in; a checkpoint that is shipped (demo/, exports) must not carry the writer's paths, and
  orbax only checks that the markers exist."""
  for marker in [path / _COMMIT_MARKER] + [path / item / _COMMIT_MARKER
                                           for item in (_STATE_ITEM, _METADATA_ITEM)]:
    if marker.exists():
      marker.write_text('Checkpoint commit was successful.\n')


def load_tree(path, abstract_tree=None) -> tuple[Any, dict]:
  """Restores `(tree, metadata)` from a `save_tree` directory as host (numpy) arrays.

  Leaves keep their stored dtype. Without `abstract_tree` the tree comes back as nested
  dicts with string keys; with it, the tree takes its structure, and any missing, extra or
  mis-shaped leaf raises CheckpointError. Needs no devices or shardings of the writer.
  """
  path = _as_path(path)
  metadata, checksums = _split_checksums(_read_metadata(path))
  checkpointer = _checkpointer()
  stored = _stored_tree(path, lambda: checkpointer.metadata(path))
  if abstract_tree is not None:
    _check_against(path, stored, abstract_tree)
  target = stored if abstract_tree is None else abstract_tree
  restore = ocp.args.PyTreeRestore(
      item=abstract_tree, restore_args=_numpy_restore_args(target))
  try:
    restored = checkpointer.restore(path, args=ocp.args.Composite(**{_STATE_ITEM: restore}))
  except Exception as e:
    raise _corrupt(path, e) from e
  _verify(path, restored[_STATE_ITEM], checksums, stored)
  return restored[_STATE_ITEM], metadata


def save_model(path, model: nnx.Module, *, kind: str, config: dict,
               storage_dtype: str = 'float32', extra: Optional[dict] = None,
               force: bool = False) -> None:
  """Saves a module's `nnx.Param`s (floats cast to `storage_dtype`) with its config.

  `kind` names the model family ('target', 'mtp', 'dflash', ...) and is checked on load.
  Weights that are not finite (NaN or Inf, also after the cast) and config numbers that
  loading would refuse (`read_model_metadata`) raise CheckpointError.
  """
  if storage_dtype not in STORAGE_DTYPES:
    raise ValueError(f'storage_dtype must be one of {STORAGE_DTYPES}, got {storage_dtype!r}')
  _check_config_numbers(path, config, 'refusing to save:')
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  params = jax.tree.map(
      lambda x: x.astype(storage_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
      params)
  for name, leaf in leaf_paths(params).items():
    if jnp.issubdtype(leaf.dtype, jnp.floating) and not bool(jnp.isfinite(leaf).all()):
      raise CheckpointError(f'{_as_path(path)}: refusing to save a model with non-finite '
                            f'weights (NaN or Inf in {name!r})')
  metadata = dict(kind=kind, config=config, storage_dtype=storage_dtype, extra=extra or {},
                  dspec_format_version=FORMAT_VERSION)
  save_tree(path, params, metadata, force=force)


def _check_model_metadata(path, metadata: dict, kind: str) -> None:
  version = metadata.get('dspec_format_version')
  if not isinstance(version, int) or version > FORMAT_VERSION:
    raise CheckpointError(f'{path}: unsupported dspec_format_version {version!r} '
                          f'(this dspec reads <= {FORMAT_VERSION})')
  if metadata.get('kind') != kind:
    raise CheckpointError(f'{path}: checkpoint holds a {metadata.get("kind")!r} model, '
                          f'expected {kind!r}')


def load_model_state(path, model: nnx.Module, kind: str) -> dict:
  """Restores saved params into `model` (abstract or concrete) in place; returns metadata.

  Each param is cast to the dtype the module declares for it.
  """
  path = _as_path(path)
  _check_model_metadata(path, _read_metadata(path), kind)
  state = nnx.state(model, nnx.Param)
  abstract = nnx.to_pure_dict(state)
  restored, metadata = load_tree(path, abstract)
  params = jax.tree.map(lambda x, ref: jnp.asarray(x, dtype=ref.dtype), restored, abstract)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)
  return metadata


def load_backbone_state(path, model: nnx.Module, kind: str) -> list[str]:
  """Restores a `kind` checkpoint whose params are a subset of `model`'s (e.g. a DFlash
  backbone into DFlash-2 or DSpark); returns the names of the params left as they were.

  Every stored param must find a param of the same name and shape in `model`.
  """
  path = _as_path(path)
  _check_model_metadata(path, _read_metadata(path), kind)
  state = nnx.state(model, nnx.Param)
  params = leaf_paths(nnx.to_pure_dict(state))
  stored, _ = load_tree(path)
  stored = leaf_paths(stored)
  misfit = sorted(name for name, leaf in stored.items()
                  if name not in params or _shape(leaf) != _shape(params[name]))
  if misfit:
    raise CheckpointError(f'{path}: {len(misfit)} stored params have no param of that name '
                          f'and shape in the model, e.g. {misfit[0]}')
  merged = {name: jnp.asarray(stored[name], dtype=ref.dtype) if name in stored else ref
            for name, ref in params.items()}
  treedef = jax.tree.structure(nnx.to_pure_dict(state))
  nnx.replace_by_pure_dict(state, jax.tree.unflatten(treedef, list(merged.values())))
  nnx.update(model, state)
  return sorted(set(params) - set(stored))


def read_model_kind(path) -> Optional[str]:
  """The `kind` a `save_model` checkpoint holds ('target', 'dflash', ...; reads no arrays)."""
  return _read_metadata(_as_path(path)).get('kind')


def read_model_metadata(path, kind: str) -> dict:
  """Validated metadata of a `save_model` checkpoint of `kind` (reads no arrays): every
  number of its config finite and in range (`config_checks.check_stored_config`)."""
  path = _as_path(path)
  metadata, _ = _split_checksums(_read_metadata(path))
  _check_model_metadata(path, metadata, kind)
  _check_config_numbers(path, metadata.get('config'), 'bad metadata:')
  return metadata


def _check_config_numbers(path, config, what: str) -> None:
  """CheckpointError naming `path` and the field unless every number of `config` is
  finite and in range (`config_checks.check_stored_config`)."""
  try:
    check_stored_config(config, 'config.')
  except UserError as e:
    raise CheckpointError(f'{path}: {what} {e}') from None


def read_train_step(path) -> int:
  """The training step a model export was written at (`extra.train_step`; 0 if absent)."""
  extra = _read_metadata(_as_path(path)).get('extra') or {}
  step = extra.get('train_step', 0)
  if not isinstance(step, int) or step < 0:
    raise CheckpointError(f'{path}: bad extra.train_step {step!r} in metadata')
  return step


class TrainCheckpointer:
  """Numbered training checkpoints (params, optax state, step, ...) under one directory.

  A thin wrapper over `ocp.CheckpointManager`: saves are asynchronous (call `wait()` before
  reading them back or exiting), only the newest `max_to_keep` steps are kept, and
  unfinished saves are never listed. Saves record array checksums, which `restore` checks.
  """

  def __init__(self, directory, *, max_to_keep: int = 3):
    self.directory = _as_path(directory)
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        item_handlers=_item_handlers())

  def save(self, step: int, tree, metadata: dict) -> None:
    """Starts saving `tree` and `metadata` as `step` (returns before the write finishes)."""
    metadata = dict(metadata, **{_CHECKSUMS: tree_checksums(tree)})
    self._manager.save(step, args=ocp.args.Composite(
        **{_STATE_ITEM: ocp.args.PyTreeSave(tree),
           _METADATA_ITEM: ocp.args.JsonSave(metadata)}))

  def latest_step(self) -> Optional[int]:
    """Newest finished step, or None when there is none."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """Finished steps still on disk, oldest first."""
    return list(self._manager.all_steps())

  def restore(self, step: int, abstract_tree) -> tuple[Any, dict]:
    """Restores `(tree, metadata)` of `step` in the structure of `abstract_tree`.

    Leaves with a sharding (jax.Array, or ShapeDtypeStruct with `sharding`) are restored
    with it; others come back as numpy arrays. Dtypes follow `abstract_tree`. A damaged
    step (unreadable, or an array that fails its checksum) raises CheckpointError.
    """
    where = self.directory / str(step)
    if step not in self._manager.all_steps():
      raise CheckpointError(f'{where}: no finished checkpoint for step {step} '
                            f'(have {self.all_steps()})')
    stored = _stored_tree(where, lambda: self._manager.metadata(step))
    _check_against(where, stored, abstract_tree)
    restore = ocp.args.PyTreeRestore(item=abstract_tree,
                                     restore_args=jax.tree.map(_restore_arg, abstract_tree))
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          **{_STATE_ITEM: restore, _METADATA_ITEM: ocp.args.JsonRestore()}))
    except Exception as e:
      raise _corrupt(where, e) from e
    metadata, checksums = _split_checksums(restored[_METADATA_ITEM] or {})
    _verify(where, restored[_STATE_ITEM], checksums, stored)
    return restored[_STATE_ITEM], metadata

  def quarantine(self, step: int) -> epath.Path:
    """Renames a damaged step's directory to `corrupt_<step>[_n]` (kept, never listed again)
    so that training can go on from an older step; returns the new path."""
    self.wait()
    target = self.directory / f'corrupt_{step}'
    n = 1
    while target.exists():
      target = self.directory / f'corrupt_{step}_{n}'
      n += 1
    (self.directory / str(step)).rename(target)
    self._manager.reload()
    return target

  def wait(self) -> None:
    """Blocks until pending saves are on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the manager."""
    self._manager.close()

  def __enter__(self) -> 'TrainCheckpointer':
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _restore_arg(leaf):
  sharding = getattr(leaf, 'sharding', None)
  if sharding is not None:
    return ocp.ArrayRestoreArgs(sharding=sharding, global_shape=tuple(leaf.shape),
                                dtype=leaf.dtype)
  return ocp.RestoreArgs(restore_type=np.ndarray, dtype=leaf.dtype)
