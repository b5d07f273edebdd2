"""The controller's step-cost table: seconds per engine step for each (batch size, tier).

Profiled tables are cached beside the persistent XLA cache (`cached_path`: a
`controller_costs/` folder in `jax_compilation_cache_dir`, none when that cache is off), so
a second run of the same job on the same machine neither compiles nor profiles; and in this
process (`PROFILED`) for `runner.decode`'s controllers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from typing import Callable, Dict, Optional, Tuple

import jax
import numpy as np

from dspec import distributed, files

CACHE_SUBDIR = 'controller_costs'


def cache_dir() -> Optional[str]:
  """Where profiled tables are cached: beside the persistent XLA cache, or None (off)."""
  xla_dir = jax.config.jax_compilation_cache_dir
  return os.path.join(xla_dir, CACHE_SUBDIR) if xla_dir else None


def fingerprint(setup, arrays) -> str:
  """A key of the tables measured for `setup` (reprs of drafter, tiers, sampling, mesh,
  ...) and the shapes and dtypes of `arrays` (params, decode state) on this backend and
  device kind."""
  shapes = [(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(arrays)]
  # Reprs name functions by address (`<function f at 0x7f..>`): stable without it.
  key = [re.sub(r' at 0x[0-9a-f]+', '', repr(setup)), shapes, jax.default_backend(),
         jax.devices()[0].device_kind, jax.device_count(), jax.__version__]
  return hashlib.sha256(json.dumps(key, default=str).encode()).hexdigest()[:32]


def cached_path(setup, arrays) -> Optional[str]:
  """The cache file of the table of `fingerprint(setup, arrays)`, or None when caching is
  off."""
  folder = cache_dir()
  return folder and os.path.join(folder, fingerprint(setup, arrays) + '.json')


# Tables profiled in this process, by `fingerprint`: what `runner.decode` shares across its
# controllers (one per call), so that generate calls in one shape bucket profile once.
PROFILED: Dict[str, 'CostTable'] = {}


class CostTable:
  """Seconds per engine step for each (batch size, tier), and of the largest tier's
  proposal alone per batch size; JSON round-trips (`save`, `load`)."""

  def __init__(self, costs: Optional[Dict[Tuple[int, int], float]] = None,
               propose: Optional[Dict[int, float]] = None, meta=None):
    self.costs = dict(costs or {})
    self.propose = dict(propose or {})   # batch -> seconds of the largest tier's proposal
    self.meta = dict(meta or {})

  def update(self, other: 'CostTable') -> None:
    """Takes `other`'s entries (a cached table of the same fingerprint)."""
    self.costs.update(other.costs)
    self.propose.update(other.propose)
    self.meta.update(other.meta)

  def of_batch(self, batch: int) -> 'CostTable':
    """A copy of the entries of one batch size (and the meta)."""
    return CostTable({k: c for k, c in self.costs.items() if k[0] == batch},
                     {batch: self.propose[batch]}, self.meta)

  def has(self, batch: int, tiers) -> bool:
    return batch in self.propose and all((batch, g) in self.costs for g in tiers)

  def __getitem__(self, key) -> float:
    return self.costs[key]

  def step_cost(self, batch: int, g: int, rate_B, live_B) -> float:
    """Expected seconds per step at tier g: the drafting step's cost when some live row
    proposes (probability 1 - Π_r (1 - π_r), π = `rate_B`), else the anchor-only
    forward's, an AR step plus the proposal (an n-gram miss verifies nothing)."""
    ar = self[batch, 0]
    if g == 0:
      return ar
    idle = np.prod(np.where(live_B, 1.0 - rate_B, 1.0))
    drafting = max(self[batch, g], ar)   # a profile below AR's is timing noise
    anchor_only = min(ar + self.propose.get(batch, 0.0), drafting)
    return float((1.0 - idle) * drafting + idle * anchor_only)

  def payable(self, batch: int, tiers, margin: float, depths=None) -> tuple:
    """Positive tiers that would beat AR by `margin` if every draft were accepted:
    (d+1)/cost(B, γ) >= (1 + margin) / cost(B, 0), d = `depths[γ]` (a tree tier's depth;
    else γ)."""
    floor = (1.0 + margin) / self[batch, 0]
    depth = lambda g: (depths or {}).get(g, g)
    return tuple(g for g in tiers if g and (depth(g) + 1) / self[batch, g] >= floor)

  def verify_cost(self, batch: int, tiers) -> float:
    """λ(B) of cost(B, γ) ≈ c0·(1 + λ·γ): least squares over `tiers`, clipped at 0; tier 0
    counts with the proposal's cost (every positive tier drafts), so c0 includes the draft
    pass. The marginal cost of one more verified draft relative to the fixed cost: DSpark's
    per-row verify-length rule (`drafters/dspark.py`)."""
    gammas = np.array(sorted(tiers), np.float64)
    costs = np.array([self[batch, int(g)] + (self.propose.get(batch, 0.0) if g == 0 else 0.0)
                      for g in gammas])
    slope, c0 = np.polyfit(gammas, costs, 1)
    c0 = c0 if c0 > 0 else costs.min()
    return max(float(slope / c0), 0.0)

  def save(self, path: str) -> None:
    rows = {}
    for (b, g), c in sorted(self.costs.items()):
      rows.setdefault(str(b), {})[str(g)] = c
    files.write_json_atomic(path, {
        'seconds_per_step': rows, 'meta': self.meta,
        'propose_seconds': {str(b): c for b, c in sorted(self.propose.items())}})

  @classmethod
  def load(cls, path: str) -> 'CostTable':
    try:
      with open(path) as f:
        data = json.load(f)
      costs = {(int(b), int(g)): float(c)
               for b, row in data['seconds_per_step'].items() for g, c in row.items()}
      propose = {int(b): float(c) for b, c in data.get('propose_seconds', {}).items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
      raise ValueError(f'bad step-cost table {path}: {e}') from e
    return cls(costs, propose, data.get('meta'))


def profile(engines: dict, propose: Callable, plain_ar, params: tuple, state, steps: int,
            repeats: int, table: CostTable) -> CostTable:
  """Fills `table` for this batch size: each tier's step (`engines[g].run` on copies of
  `state`, rounds interleaving the tiers against drift after a compile round; positive
  tiers `force_wide`: what a drafting step costs) and `propose()` alone. The meta holds
  the buffer length and the fewest steps a timed run ran (rows finish)."""
  b = state.tokens_BL.shape[0]
  jax.block_until_ready(propose())
  t0 = time.perf_counter()
  jax.block_until_ready([propose() for _ in range(steps)])
  table.propose[b] = (time.perf_counter() - t0) / steps
  copy = lambda: jax.tree.map(lambda x: x.copy(), state)
  jax.block_until_ready(plain_ar.run(*params, copy(), 1))   # compiled here, not mid-run
  best, fewest = {}, steps
  for r in range(repeats + 1):
    for g, engine in sorted(engines.items()):
      t0 = time.perf_counter()
      out = engine.run(*params, copy(), steps, force_wide=g > 0)
      done = int(distributed.host_values(out.step - state.step))
      if r:
        best[g] = min(best.get(g, float('inf')), (time.perf_counter() - t0) / max(done, 1))
        fewest = min(fewest, done)
  table.costs.update({(b, g): c for g, c in best.items()})
  table.meta.update(buffer_len=int(state.tokens_BL.shape[1]), fewest_steps=fewest)
  return table


def profile_or_load(table: CostTable, setup, arrays, state, profiled: dict, tiers,
                    run_profile: Callable[[], CostTable]) -> None:
  """Puts the table of `setup` (drafter, tiers, ...) and `arrays` (params, state) on this
  device into `table`: one profiled before in this process (`profiled`), else the one
  cached beside the XLA cache (`cached_path`), else `run_profile()`, then kept in both
  unless some tier's timed run ran no step (every row done at once: this generation's
  only). Across processes every process takes process 0's timings."""
  key = fingerprint(setup, arrays)
  path = None if distributed.active() else cached_path(setup, arrays)
  b = state.tokens_BL.shape[0]
  if key in profiled:
    table.update(profiled[key])
  elif path and os.path.exists(path):
    try:
      table.update(CostTable.load(path))
    except ValueError:   # a damaged cache entry: profiled again below, and rewritten
      pass
  if table.has(b, tiers):
    profiled.setdefault(key, table.of_batch(b))
    return
  run_profile()
  if distributed.active():
    shared = distributed.broadcast_json(
        [[[b, g, c] for (b, g), c in table.costs.items()], table.propose[b],
         table.meta['fewest_steps']])
    table.costs.update({(b, g): c for b, g, c in shared[0]})
    table.propose[b], table.meta['fewest_steps'] = shared[1], shared[2]
  if table.meta['fewest_steps'] == 0:
    return
  profiled[key] = table.of_batch(b)
  if path:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    profiled[key].save(path)
