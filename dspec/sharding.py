"""Device meshes, logical-axis rules, and the shardings of params, KV caches and state.

Mesh axes are `data` (batch), `fsdp` (batch, and the params' embed dim) and `tensor`
(heads, kv heads, MLP, vocab). Sharding is named twice over:

  param path  --PARAM_AXES-->     logical axes  --rules (config)-->  mesh axes
  state leaf  --LOGICAL_AXES-->   logical axes  --rules (config)-->  mesh axes

Params are matched by their path (`layers/0/self_attn/q_proj/kernel`), so every NNX
module built from the shared layers (target, MTP depths, DFlash layers) is covered;
unmatched params are replicated. Decode-state leaves take the logical axes their struct
declares (`LOGICAL_AXES` of `KVCache`, `DecodeState`, `MTPState`, ...); a leaf nothing
declares is an error, so renaming a field cannot silently change its sharding. The rules
place `batch` and `kv_heads`; every other state axis is replicated. Divisibility: a heads, MLP, vocab or embed size that the
mesh does not divide is a ValueError naming the dimension; kv heads that the tensor axis
does not divide are replicated instead (vLLM-style KV replication for tp > kv_heads).

Meshes use `AxisType.Auto` (GSPMD propagation), so the jitted programs are the
single-device ones with in/out shardings; `jax.set_mesh` is entered around calls so
`pallas_kernels` can wrap kernels in `jax.shard_map`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Optional, Sequence

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from dspec.models.config import TransformerConfig
from dspec.pytrees import key_name

MESH_AXES = ('data', 'fsdp', 'tensor')

# Logical axis -> mesh axis (or axes, or None = replicated): the default of every config's
# `sharding_rules` (`configs/common.py`), which a config may override.
DEFAULT_RULES = (
    ('batch', ('data', 'fsdp')),
    ('vocab', 'tensor'),
    ('embed', 'fsdp'),
    ('heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('mlp', 'tensor'),
    ('layers', None),
    ('cache_len', None),
    ('head_dim', None),
    ('norm', None),
)

# Param path regex -> logical axes of its dims; first match wins, no match: replicated.
PARAM_AXES = (
    (r'(^|/)embed_tokens$', ('vocab', 'embed')),
    (r'(^|/)lm_head$', ('embed', 'vocab')),
    (r'q_proj/kernel$', ('embed', 'heads')),
    (r'(k_proj|v_proj)/kernel$', ('embed', 'kv_heads')),
    (r'o_proj/kernel$', ('heads', 'embed')),
    (r'(gate_proj|up_proj)/kernel$', ('embed', 'mlp')),
    (r'down_proj/kernel$', ('mlp', 'embed')),
    (r'(eh_proj|fc)/kernel$', (None, 'embed')),   # MTP input projection, DFlash fusion
    (r'/weight$', ('norm',)),                     # RMSNorm weights
)

# Logical axis -> the TransformerConfig field whose size must divide by its mesh axes.
_MODEL_DIMS = {'heads': 'num_heads', 'kv_heads': 'num_kv_heads', 'mlp': 'mlp_dim',
               'vocab': 'vocab_size', 'embed': 'embed_dim'}


# ------------------------------------------------------------------------------- mesh

def parse_mesh_spec(spec: str) -> dict:
  """'data=2,tensor=4' -> {'data': 2, 'fsdp': 1, 'tensor': 4} (one size may be -1)."""
  sizes = dict.fromkeys(MESH_AXES, 1)
  seen = set()
  for item in spec.replace(' ', '').split(','):
    name, eq, value = item.partition('=')
    if name not in MESH_AXES or not eq:
      raise ValueError(f'bad mesh item {item!r} in {spec!r}: use name=size with name in '
                       f'{", ".join(MESH_AXES)}')
    if name in seen:
      raise ValueError(f'mesh axis {name!r} given twice in {spec!r}')
    try:
      size = int(value)
    except ValueError:
      raise ValueError(f'mesh axis {name}={value!r} in {spec!r} is not an integer') from None
    if size < 1 and size != -1:
      raise ValueError(f'mesh axis {name}={size} in {spec!r} must be >= 1 (or -1: the rest)')
    seen.add(name)
    sizes[name] = size
  if list(sizes.values()).count(-1) > 1:
    raise ValueError(f'at most one mesh axis may be -1 in {spec!r}')
  return sizes


def make_mesh(spec: str, devices: Optional[Sequence] = None) -> Mesh:
  """A (data, fsdp, tensor) mesh over all devices (or `devices`); sizes must multiply to
  the device count (one axis may be -1: the remaining devices)."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = parse_mesh_spec(spec)
  known = math.prod(s for s in sizes.values() if s != -1)
  for name, size in sizes.items():
    if size == -1:
      if len(devices) % known:
        raise ValueError(f'mesh {spec!r}: {len(devices)} devices do not split by {known}')
      sizes[name] = len(devices) // known
  if math.prod(sizes.values()) != len(devices):
    raise ValueError(f'mesh {spec!r} needs {math.prod(sizes.values())} devices, found '
                     f'{len(devices)}')
  shape = tuple(sizes[a] for a in MESH_AXES)
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


def maybe_initialize_distributed(enabled: bool) -> None:
  """`jax.distributed.initialize()` (multi-host) when enabled; call before any jax use.

  Arguments come from the environment: auto-detected on TPU pods and SLURM/Open MPI,
  else JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (docs/DESIGN.md, "Scale").
  """
  if enabled:
    jax.distributed.initialize()


# ------------------------------------------------------------------------------ rules

def _rule_map(rules) -> dict:
  out = {}
  for logical, axes in rules:
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    out[logical] = axes
  return out


def axis_size(mesh: Mesh, axes: Sequence[str]) -> int:
  return math.prod(mesh.shape[a] for a in axes)


def model_rules(rules, mesh: Mesh, model_cfg: Optional[TransformerConfig]) -> tuple:
  """`rules` checked against a model's sizes: ValueError naming a dimension the mesh does
  not divide; kv heads the tensor axis does not divide are replicated (rule -> None)."""
  out = []
  for logical, axes in _rule_map(rules).items():
    size = axis_size(mesh, axes)
    field = _MODEL_DIMS.get(logical)
    if model_cfg is not None and field and size > 1 and getattr(model_cfg, field) % size:
      dim = getattr(model_cfg, field)
      if logical != 'kv_heads':
        raise ValueError(f'mesh {"×".join(f"{a}={mesh.shape[a]}" for a in axes)} does not '
                         f'divide {field}={dim} (logical axis {logical!r})')
      axes = ()
    out.append((logical, axes or None))
  return tuple(out)


def partition_spec(logical_axes, shape, rules, mesh: Mesh, where: str = '') -> P:
  """PartitionSpec of an array whose dims carry `logical_axes` (None = replicated)."""
  rule = _rule_map(rules)
  used, spec = set(), []
  for dim, logical in zip(shape, logical_axes):
    axes = tuple(a for a in rule.get(logical, ()) if mesh.shape[a] > 1 and a not in used)
    if axes and dim % axis_size(mesh, axes):
      raise ValueError(f'{where or "array"}: dim {logical!r} of size {dim} is not '
                       f'divisible by mesh axes {axes} (size {axis_size(mesh, axes)})')
    used.update(axes)
    spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  while spec and spec[-1] is None:
    spec.pop()
  return P(*spec)


def path_str(path) -> str:
  """'layers/0/self_attn/q_proj/kernel' from a pytree path (NNX `.value` dropped)."""
  names = [key_name(k) for k in path]
  if names and names[-1] in ('value', 'raw_value'):
    names = names[:-1]
  return '/'.join(names)


def param_logical_axes(path: str, ndim: int):
  for pattern, axes in PARAM_AXES:
    if re.search(pattern, path) and len(axes) == ndim:
      return axes
  return (None,) * ndim


def _child(node, key):
  if isinstance(key, jax.tree_util.GetAttrKey):
    return getattr(node, key.name)
  if isinstance(key, jax.tree_util.SequenceKey):
    return node[key.idx]
  return node[key.key]


def state_logical_axes(tree, path, ndim: int) -> tuple:
  """The logical axes of a decode-state leaf, as declared by the `LOGICAL_AXES` of the
  struct holding it (`KVCache`, `DecodeState`, drafter states, ...); ValueError naming the
  leaf when nothing declares it."""
  parent = tree
  for key in path[:-1]:
    parent = _child(parent, key)
  axes = getattr(type(parent), 'LOGICAL_AXES', {}).get(key_name(path[-1]))
  if axes is None or len(axes) != ndim:
    raise ValueError(f'state leaf {path_str(path)!r} ({ndim} dims) has no declared logical '
                     f'axes: add it to LOGICAL_AXES of {type(parent).__name__}')
  return axes


def find_model_config(tree) -> Optional[TransformerConfig]:
  """The first TransformerConfig held by an NNX module graph (cfg, target_cfg, ...)."""
  if not isinstance(tree, nnx.Module):
    return None
  for _, node in nnx.iter_graph(tree):
    for attr in ('target_cfg', 'cfg'):
      value = getattr(node, attr, None)
      if isinstance(value, TransformerConfig):
        return value
  return None


# -------------------------------------------------------------------------- placement

@dataclasses.dataclass(frozen=True)
class Placement:
  """A mesh plus the rules for one model family: where params, caches and state go."""

  mesh: Mesh
  rules: tuple

  @classmethod
  def create(cls, spec: str, rules=DEFAULT_RULES, model_cfg=None, devices=None):
    mesh = make_mesh(spec, devices)
    return cls(mesh, model_rules(rules, mesh, model_cfg))

  def for_model(self, model_cfg: Optional[TransformerConfig]) -> 'Placement':
    """The same mesh with the rules checked against (and fitted to) a model's sizes."""
    return Placement(self.mesh, model_rules(self.rules, self.mesh, model_cfg))

  @property
  def batch_size_multiple(self) -> int:
    return axis_size(self.mesh, _rule_map(self.rules).get('batch', ()))

  def _tree_specs(self, tree, axes_fn) -> Any:
    def one(path, x):
      if not hasattr(x, 'shape'):
        return x
      where = path_str(path)
      return partition_spec(axes_fn(where, x.ndim), x.shape, self.rules, self.mesh, where)
    return jax.tree_util.tree_map_with_path(one, tree)

  def param_specs(self, tree) -> Any:
    """PartitionSpec per param leaf (by path through PARAM_AXES)."""
    return self._tree_specs(tree, param_logical_axes)

  def state_specs(self, tree) -> Any:
    """PartitionSpec per decode-state leaf (by its declared `LOGICAL_AXES`)."""
    def one(path, x):
      if not hasattr(x, 'shape'):
        return x
      return partition_spec(state_logical_axes(tree, path, x.ndim), x.shape, self.rules,
                            self.mesh, path_str(path))
    return jax.tree_util.tree_map_with_path(one, tree)

  def batch_specs(self, tree) -> Any:
    """Leading axis of every leaf on the batch axes (training batches)."""
    return self._tree_specs(tree, lambda p, n: ('batch',) + (None,) * (n - 1))

  def shardings(self, specs) -> Any:
    return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs,
                        is_leaf=lambda s: isinstance(s, P))

  def put(self, tree, specs) -> Any:
    """device_put of `tree` with `specs` (a pytree of PartitionSpecs)."""
    if tree is None:
      return None
    return jax.device_put(tree, self.shardings(specs))

  def put_params(self, tree):
    return self.put(tree, self.param_specs(tree))

  def put_state(self, tree):
    return self.put(tree, self.state_specs(tree))

  def put_batch(self, tree):
    return self.put(tree, self.batch_specs(tree))

  def create_module(self, ctor: Callable[[], nnx.Module]) -> nnx.Module:
    """Builds `ctor()` with every param created already sharded (jit out_shardings over
    the `nnx.eval_shape` state), never materialised on one device."""
    graphdef, abstract = nnx.split(nnx.eval_shape(ctor))
    shardings = self.shardings(self.param_specs(abstract))
    state = jax.jit(lambda: nnx.split(ctor())[1], out_shardings=shardings)()
    return nnx.merge(graphdef, state)

  def init_sharded(self, fn, *args):
    """`fn(*args)` (e.g. an optimizer init) with its outputs created already sharded by
    the param rules, in one compiled call."""
    specs = self.param_specs(jax.eval_shape(fn, *args))
    return jax.jit(fn, out_shardings=self.shardings(specs))(*args)

  def context(self):
    """`jax.set_mesh(mesh)`: lets kernels see the mesh while tracing."""
    return jax.set_mesh(self.mesh)

  def jit(self, fn, **jit_kwargs):
    """`jax.jit(fn, **jit_kwargs)` whose calls run under `context()`."""
    jitted = jax.jit(fn, **jit_kwargs)

    def call(*args):
      with self.context():
        return jitted(*args)
    return call


def placement_from_config(cfg, model_cfg=None) -> Optional[Placement]:
  """The Placement of a config with `mesh` (and optional `sharding_rules`); None if ''."""
  spec = cfg.get('mesh', '')
  if not spec:
    return None
  rules = cfg.get('sharding_rules', None) or DEFAULT_RULES
  return Placement.create(spec, tuple(tuple(r) for r in rules), model_cfg)


def place_module(module: nnx.Module, placement: Optional[Placement]) -> nnx.Module:
  """Moves a built module's params onto the mesh in place (loaded checkpoints)."""
  if placement is not None:
    nnx.update(module, placement.put_params(nnx.state(module)))
  return module


def place_tree(tree, placement: Placement):
  """Params of any pytree (an NNX module is updated in place) onto the mesh."""
  if isinstance(tree, nnx.Module):
    return place_module(tree, placement)
  return placement.put_params(tree)


def spec_summary(specs) -> dict:
  """{param path: PartitionSpec as a list} (golden files, docs)."""
  flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda s: isinstance(s, P))[0]
  return {path_str(p): [list(a) if isinstance(a, tuple) else a for a in s]
          for p, s in flat}

