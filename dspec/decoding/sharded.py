"""A SpeculativeEngine run on a device mesh: the same jitted programs, with in/out shardings.

`ShardedEngine(engine, placement)` has the engine's `prefill / run / generate / step`
signatures (so `runner`, `host_loop` and the controller use it unchanged) and runs the
engine's own step driver (`run_fn`); its programs (keyed by the state's shapes, since their
in/out shardings follow from them) live in one LRU per engine and placement, so a new
`ShardedEngine` over the same pair (every `generate` call builds one) compiles nothing. Params keep the sharding
they were placed with (`Placement.put_params` / `create_module`); the decode state (target
cache, tokens, drafter state, stats) is sharded by its shape-suffix names: batch over the
`batch` mesh axes, KV heads over `tensor`. Calls run under `jax.set_mesh`, so Pallas
kernels are wrapped in `jax.shard_map` (see `pallas_kernels/block_attention/api.py`).

Across processes (`dspec.distributed`) the leaves the host reads between calls (tokens,
counts, done flags, stats) are replicated, so every process reads the same values and the
controller takes the same decisions everywhere; prompts enter as global arrays.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from dspec import distributed
from dspec.compiled_programs import ProgramCache
from dspec.decoding.engine import NO_STEP_LIMIT, SpeculativeEngine
from dspec.sharding import Placement


def _shardings_of(tree):
  return None if tree is None else jax.tree.map(lambda x: x.sharding, tree)


# The programs of each (engine, placement), built by `ShardedEngine._jitted`.
_PROGRAMS = ProgramCache(lambda engine_and_placement: {})


class ShardedEngine:
  """`engine`'s entry points jitted with mesh shardings (one compile per shape)."""

  def __init__(self, engine: SpeculativeEngine, placement: Placement):
    self.engine = engine
    self.placement = placement
    self._fns = _PROGRAMS((engine, placement), ())

  def __getattr__(self, name):
    return getattr(self.engine, name)

  def _state_sh(self, tree):
    specs = self.placement.state_specs(tree)
    if distributed.active() and hasattr(specs, 'stats'):   # a DecodeState: host-readable
      specs = specs.replace(tokens_BL=P(), num_tokens_B=P(), prompt_len_B=P(), done_B=P(),
                            stats=jax.tree.map(lambda _: P(), specs.stats,
                                               is_leaf=lambda x: isinstance(x, P)))
    return self.placement.shardings(specs)

  def _placed(self, state):
    """Across processes, `state` moved to the shardings the programs take (a no-op for
    leaves already there, e.g. a state a caller re-placed with `put_state`)."""
    return jax.device_put(state, self._state_sh(state)) if distributed.active() else state

  def _jitted(self, kind, key, build):
    if (kind, key) not in self._fns:
      self._fns[kind, key] = build()
    return self._fns[kind, key]

  def prefill(self, target_params, drafter_params, prompt_BP, prompt_len_B, *,
              temperature=0.0, top_p=1.0, max_new_tokens, seed=0, buffer_len=None):
    b, p = prompt_BP.shape
    multiple = self.placement.batch_size_multiple
    if b % multiple:
      raise ValueError(f'batch size {b} is not divisible by the mesh batch axes '
                       f'(size {multiple}); use a multiple of {multiple}')
    buffer_len = buffer_len or self.engine.buffer_len(p, max_new_tokens)
    args = (target_params, drafter_params, prompt_BP, prompt_len_B, temperature, top_p,
            max_new_tokens, seed)

    def build():
      fn = functools.partial(self.engine.prefill_fn, buffer_len=buffer_len)
      out = jax.eval_shape(fn, *args)
      batch_in = self.placement.shardings(self.placement.batch_specs(
          {'prompt_BP': prompt_BP, 'prompt_len_B': prompt_len_B}))
      rep = self.placement.shardings(jax.sharding.PartitionSpec())
      return jax.jit(fn, in_shardings=(
          _shardings_of(target_params), _shardings_of(drafter_params),
          batch_in['prompt_BP'], batch_in['prompt_len_B'], rep, rep, rep, rep),
          out_shardings=self._state_sh(out))

    fn = self._jitted('prefill', (b, p, buffer_len), build)
    if distributed.active():   # global arrays, each process holding its devices' rows
      prompt_BP, prompt_len_B = self.placement.put_batch((prompt_BP, prompt_len_B))
      args = (target_params, drafter_params, prompt_BP, prompt_len_B) + args[4:]
    with self.placement.context():
      return fn(*args)

  def step(self, target_params, drafter_params, state, proposal=None):
    state = self._placed(state)

    def build():
      state_sh = self._state_sh(state)
      return jax.jit(self.engine.step_fn, donate_argnums=2, in_shardings=(
          _shardings_of(target_params), _shardings_of(drafter_params), state_sh,
          None if proposal is None else self._state_sh(proposal)),
          out_shardings=state_sh)

    key = (jax.tree.structure(state), jax.tree.structure(proposal),
           tuple(x.shape for x in jax.tree.leaves(state)))
    fn = self._jitted('step', key, build)
    with self.placement.context():
      return fn(target_params, drafter_params, state, proposal)

  def run(self, target_params, drafter_params, state, max_steps=None, *,
          until_row_done: bool = False, force_wide: bool = False):
    state = self._placed(state)

    def build():
      state_sh = self._state_sh(state)
      rep = self.placement.shardings(jax.sharding.PartitionSpec())
      fn = functools.partial(self.engine.run_fn, until_row_done=until_row_done)
      return jax.jit(fn, donate_argnums=2, in_shardings=(
          _shardings_of(target_params), _shardings_of(drafter_params), state_sh, rep, rep),
          out_shardings=state_sh)

    key = (until_row_done, jax.tree.structure(state),
           tuple(x.shape for x in jax.tree.leaves(state)))
    fn = self._jitted('run', key, build)
    rep = self.placement.shardings(jax.sharding.PartitionSpec())
    limit = jax.device_put(np.int32(NO_STEP_LIMIT if max_steps is None else max_steps), rep)
    wide = jax.device_put(np.bool_(force_wide), rep)   # traced, as the engine's: no recompile
    with self.placement.context():
      return fn(target_params, drafter_params, state, limit, wide)

  def generate(self, target_params, drafter_params, state):
    return self.run(target_params, drafter_params, state)

