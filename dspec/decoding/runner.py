"""Running a generation: sampling settings, engines, timing, metrics and the AR comparison.

`decode` is what `dspec.generate` and the decode job (`run_decode`, behind
`scripts/decode.py`) share: prompts in; texts, ids, metrics and an optional trace out.
Timing follows docs/DESIGN.md ("Metrics"): a warm-up run compiles, `timing_repeats` timed
runs follow and their medians count; AR runs in the same process on the same prompts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from flax import nnx

from dspec import config_checks, datasets, loading, sharding
from dspec.decoding import costs as costs_lib
from dspec.decoding import drafter as drafter_lib
from dspec.decoding.constrained_loop import Constrained, generate_constrained
from dspec.decoding.controller import VerifyLengthController
from dspec.decoding.drafters import registry
from dspec.decoding.engine import SpeculativeEngine
from dspec.decoding.host_loop import HostEngine
from dspec.decoding.policy import ControllerConfig
from dspec.decoding.prompts import (bucket_shapes, encode_prompts, generated_ids,
                                    pad_prompts)
from dspec.sampling import SamplingSpec
from dspec.decoding.state import TreeTrace
from dspec.decoding.tree_engine import TreeConfig, TreeEngine
from dspec.errors import UserError
from dspec.metrics import acceptance_metrics

INT32_MAX = 2**31 - 1
VERIFY_LENGTHS = ('auto', 'fixed', 'tree', 'auto_tree')
# Drafter fields no tree proposer honours (`tree_proposers`): a DFlash tree is one block
# pass (no denoising steps), a DSpark tree a beam over the Markov walk (no confidence-head
# verify lengths, so no budget or cost). Tree modes refuse them away from their defaults.
TREE_IGNORED_FIELDS = ('denoise_steps', 'verify_budget', 'verify_cost')


@dataclasses.dataclass(frozen=True)
class Settings:
  """What one generation call is asked for (validated on construction)."""

  max_new_tokens: int = 64
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  timing_repeats: int = 0       # 0: one run, timed as it comes (compilation included)

  def __post_init__(self):
    for name in ('temperature', 'top_p'):
      if not math.isfinite(getattr(self, name)):
        raise ValueError(f'{name} must be a finite number, got {getattr(self, name)}')
    if not 1 <= self.max_new_tokens <= INT32_MAX // 2:
      raise ValueError(f'max_new_tokens must be in [1, {INT32_MAX // 2}], '
                       f'got {self.max_new_tokens}')
    if not 0 <= self.seed <= INT32_MAX:
      raise ValueError(f'seed must be in [0, 2**31 - 1], got {self.seed}')
    if self.timing_repeats < 0:
      raise ValueError(f'timing_repeats must be >= 0, got {self.timing_repeats}')
    self.sampling()

  @classmethod
  def from_config(cls, cfg) -> 'Settings':
    return cls(int(cfg.max_new_tokens), float(cfg.temperature), int(cfg.top_k),
               float(cfg.top_p), int(cfg.seed), int(cfg.timing_repeats))

  def sampling(self) -> SamplingSpec:
    return SamplingSpec.create(self.temperature, self.top_k, self.top_p)


@dataclasses.dataclass
class Target:
  """A target model ready to decode: the module, its tokenizer and context length."""

  model: Any
  tokenizer: Any
  max_seq_len: int = 4096
  _split: Optional[tuple] = dataclasses.field(default=None, init=False, repr=False)

  def split(self):
    """(graphdef, params) of the model, split once."""
    if self._split is None:
      self._split = nnx.split(self.model)
    return self._split


def run_generation(engine, target_params, drafter_params, prompt_BP, prompt_len_B,
                   settings: Settings, buffer_len: Optional[int] = None,
                   constrained: Optional[Constrained] = None):
  """prefill + decode once; returns (final state, prefill seconds, decode seconds).
  buffer_len: the token buffer's (`SpeculativeEngine.prefill`; None: the engine's own).
  `constrained`: structured output, every step masked by the rows' matchers
  (`constrained_loop`)."""
  t0 = time.perf_counter()
  rows = constrained and constrained.start(prompt_BP.shape[0])
  masked = {'allowed_BW': jax.device_put(rows.next_masks())} if rows else {}
  state = engine.prefill(target_params, drafter_params, prompt_BP, prompt_len_B,
                         temperature=settings.temperature, top_p=settings.top_p,
                         max_new_tokens=settings.max_new_tokens, seed=settings.seed,
                         buffer_len=buffer_len, **masked)
  jax.block_until_ready(state)
  t1 = time.perf_counter()
  if rows:
    state = generate_constrained(engine, target_params, drafter_params, state, rows)
  else:
    state = engine.generate(target_params, drafter_params, state)
  jax.block_until_ready(state)
  return state, t1 - t0, time.perf_counter() - t1


@dataclasses.dataclass(frozen=True)
class Generation:
  """What one timed generation runs: an engine, its params and constraints
  (`run_generation`)."""

  engine: object
  target_params: object
  drafter_params: object = None
  constrained: Optional[Constrained] = None


def timed_generations(generations: Sequence[Generation], prompt_BP, prompt_len_B,
                      settings: Settings, buffer_len: Optional[int] = None) -> list:
  """For each generation a warm-up (compile) run, then `timing_repeats` rounds that run
  every generation once in turn (interleaved, so the machine's drift falls on all alike;
  round r starts at generation r - 1, so none always runs first or after the same one);
  each result reports the medians of its timed runs (and every timed run's decode time,
  `decode_s_rounds`) and the last run's state. With `timing_repeats` 0 the single run is
  the result (its time includes compilation). buffer_len: see `run_generation`."""
  n = len(generations)
  states, first_s = [None] * n, [0.0] * n
  times = [[] for _ in generations]        # (prefill s, decode s) of each timed run
  for r in range(1 + settings.timing_repeats):
    for i in (np.arange(n) + max(r - 1, 0)) % n:
      g = generations[i]
      t = time.perf_counter()
      states[i], prefill_s, decode_s = run_generation(
          g.engine, g.target_params, g.drafter_params, prompt_BP, prompt_len_B, settings,
          buffer_len, g.constrained)
      if r == 0:
        first_s[i] = time.perf_counter() - t
      if r or not settings.timing_repeats:   # no timed rounds: the warm-up's time counts
        times[i].append((prefill_s, decode_s))
  results = []
  for state, timed, first in zip(states, times, first_s):
    prefill_s = statistics.median(p for p, _ in timed)
    decode_s = statistics.median(d for _, d in timed)
    num_tokens_B, lens_B = jax.device_get((state.num_tokens_B, state.prompt_len_B))
    new_tokens = int(np.sum(num_tokens_B - lens_B))
    results.append({
        'state': state, 'decode_s': decode_s, 'prefill_s': prefill_s,
        'decode_s_rounds': [d for _, d in timed],
        'compile_s': max(0.0, first - decode_s - prefill_s) if settings.timing_repeats
        else 0.0,
        'new_tokens': new_tokens, 'tokens_per_s': new_tokens / max(decode_s, 1e-9)})
  return results


def trace_of(state, tiers: Optional[Sequence[int]] = None) -> dict:
  """Row 0's per-step trace of an engine built with `trace=True`: the drafted tokens
  (a tree engine: the tree's tokens and parents, node 0 the anchor, and the accepted
  path's node ids), how many were accepted, the tokens committed (and the controller's
  tier)."""
  trace, stats, tokens, prompt_len = jax.device_get(
      (state.trace, state.stats, state.tokens_BL[0], state.prompt_len_B[0]))
  pos = int(prompt_len) + 1   # after the prefill's token
  steps = []
  for s in range(int(stats.steps_B[0])):
    count, accepted = int(stats.row0_committed_S[s]), int(trace.num_accepted_S[s])
    entry = {'step': s}
    if isinstance(trace, TreeTrace):
      num = int(trace.num_nodes_S[s])
      entry.update(tree={'tokens': trace.tokens_SN[s, :num].tolist(),
                         'parents': trace.parents_SN[s, :num].tolist()},
                   accepted_path=trace.path_SD1[s, :accepted + 1].tolist())
    else:
      entry['proposed'] = trace.drafts_SG[s, :int(trace.num_proposed_S[s])].tolist()
    entry.update(accepted=accepted, committed=tokens[pos:pos + count].tolist())
    if tiers is not None and s < len(tiers):
      entry['tier'] = int(tiers[s])
    steps.append(entry)
    pos += count
  return {'first_token': int(tokens[int(prompt_len)]), 'steps': steps}


def check_tree_fields(verify_length: str, drafter_name: str, fields) -> None:
  """UserError naming each field of `fields` (drafter `drafter_name`'s settings, a mapping)
  that verify_length tree or auto_tree would ignore (`TREE_IGNORED_FIELDS`) and that is
  set away from its default, so that it is not silently dropped."""
  if 'tree' not in verify_length:
    return
  defaults = registry.DEFAULTS.get(drafter_name, {})
  ignored = [f'drafters.{drafter_name}.{name}={fields[name]}'
             for name in TREE_IGNORED_FIELDS
             if name in defaults and name in fields and fields[name] != defaults[name]]
  if ignored:
    raise UserError(f'verify_length={verify_length} does not honour {", ".join(ignored)}: '
                    f'leave {"it" if len(ignored) == 1 else "them"} at the default, or use '
                    'verify_length=fixed or auto')


def check_verify_length(verify_length) -> None:
  """UserError unless `verify_length` is one of `VERIFY_LENGTHS`."""
  if verify_length not in VERIFY_LENGTHS:
    raise UserError(f'verify_length must be one of {VERIFY_LENGTHS}, got {verify_length!r}')


def speculative_engine(graphdef, drafter=None, spec: SamplingSpec = SamplingSpec(),
                       stop_ids: Sequence[int] = (), *, verify_length: str = 'auto',
                       trace: bool = False, controller: ControllerConfig = ControllerConfig(),
                       placement: Optional[sharding.Placement] = None,
                       tree: TreeConfig = TreeConfig(), profiled: Optional[dict] = None,
                       cost_table: Optional[costs_lib.CostTable] = None):
  """The engine for `drafter` (None: plain AR); the one place engines are built (library,
  benchmarks and scripts; a test over the source checks it). With verify_length 'auto'
  the load-aware controller, which picks each chunk's verify length from
  `controller.tiers` (up to the drafter's num_draft; tier 0 is plain AR; with a mesh
  `placement` every tier's engine runs on it; a host-side drafter's positive tiers are
  `HostEngine`s); with 'fixed' (and for AR) every step verifies the whole proposal
  (a host-side drafter's: `HostEngine`); with
  'tree' every step verifies a token tree of up to `tree.num_nodes` nodes
  (`drafter.tree_proposer`) in one target pass; with 'auto_tree' the controller picks each
  chunk's node budget: trees of g + 1 nodes for the tiers g < tree.num_nodes - 1 and
  tree.num_nodes itself, or AR (tier 0). profiled, cost_table: the controller's profiled
  tables and prior costs (`VerifyLengthController`)."""
  check_verify_length(verify_length)
  drafter = drafter_lib.NoDrafter() if drafter is None else drafter
  stop_ids = tuple(stop_ids)
  gamma = drafter.num_draft
  if verify_length in ('tree', 'auto_tree'):
    if gamma == 0 or isinstance(drafter, drafter_lib.HostProposing):
      raise ValueError(f'verify_length={verify_length} runs a device drafter (use fixed or '
                       'auto for host-side drafters)')
    if placement is not None and trace:
      raise ValueError(f'verify_length={verify_length} on a mesh records no trace '
                       '(--trace_json: one device)')
    check_tree_fields(verify_length, registry.name_of(drafter),
                      {name: getattr(drafter, name) for name in TREE_IGNORED_FIELDS
                       if hasattr(drafter, name)})
    if verify_length == 'auto_tree':
      budgets = {g for g in controller.tiers if g < tree.num_nodes - 1}
      return VerifyLengthController(
          graphdef, drafter, sampling=spec, stop_ids=stop_ids, tree=tree, trace=trace,
          config=dataclasses.replace(controller, tiers=tuple(sorted(
              budgets | {tree.num_nodes - 1}))), placement=placement, profiled=profiled,
          cost_table=cost_table)
    chain = SpeculativeEngine(graphdef, drafter=drafter, sampling=spec, stop_ids=stop_ids,
                              placement=placement)
    return TreeEngine(chain, drafter.tree_proposer(tree.top_k), tree.num_nodes,
                      max_depth=min(tree.num_nodes - 1, gamma), trace=trace)
  if verify_length == 'fixed' or gamma == 0:
    engine = SpeculativeEngine(graphdef, drafter=drafter, sampling=spec, stop_ids=stop_ids,
                               trace=trace, placement=placement)
    host_factory = drafter_lib.host_drafter_factory(drafter)
    return HostEngine(engine, host_factory) if host_factory else engine
  tiers = tuple(sorted({g for g in controller.tiers if g < gamma} | {gamma}))
  return VerifyLengthController(graphdef, drafter, sampling=spec, stop_ids=stop_ids,
                                config=dataclasses.replace(controller, tiers=tiers),
                                trace=trace, placement=placement, profiled=profiled,
                                cost_table=cost_table)


def _transfer_guard(debug: bool):
  """No implicit host/device transfers inside (`debug`), else no-op."""
  return jax.transfer_guard('disallow') if debug else contextlib.nullcontext()


def decode(target: Target, prompts: Sequence, drafter=None, drafter_params=None, *,
           settings: Settings = Settings(), batch_size: int = 0, compare_ar: bool = False,
           verify_length: str = 'auto', trace: bool = False, debug: bool = False,
           placement: Optional[sharding.Placement] = None,
           controller: ControllerConfig = ControllerConfig(), tree: TreeConfig = TreeConfig(),
           constraints=None, forced_drafts: bool = True,
           progress: Callable[[str], None] = lambda message: None) -> dict:
  """Generates continuations of `prompts` (texts or token-id lists) with `drafter`.

  batch_size 0: one row per prompt; a larger batch repeats the prompts cyclically. The
  prompt width and the token buffer are padded to shape buckets (`prompts.bucket_shapes`),
  so calls on other prompt lengths and max_new_tokens in the same buckets reuse the
  compiled programs and the controller's profile (`costs.PROFILED`). With
  `compare_ar`, AR runs on the same prompts (its timed runs interleaved with these) and
  the report gets `speedup` (AR decode time / this decode time; medians), `speedup_rounds`
  (the same ratio within each timed round) and `lossless` (greedy: outputs equal AR's).
  verify_length, controller, placement: see `speculative_engine`. debug:
  generation runs under `jax.transfer_guard('disallow')`, so an implicit host/device
  transfer is an error. constraints: structured output (`constrained_run`), with
  `forced_drafts` drafting the tokens a constraint forces; AR compares under the same
  constraints.
  Returns {'texts', 'ids', 'metrics', 'per_prompt', 'trace'} (ids / texts per prompt).
  """
  drafter = drafter or drafter_lib.NoDrafter()
  spec = settings.sampling()
  rows = encode_prompts(prompts, target.tokenizer, target.model.cfg.vocab_size,
                        target.max_seq_len, settings.max_new_tokens, int(drafter.num_draft),
                        f'drafters.{registry.name_of(drafter)}.num_draft')
  if batch_size and batch_size < len(rows):
    raise ValueError(f'{len(rows)} prompts do not fit batch_size={batch_size}')
  width, buffer_len = bucket_shapes(max(map(len, rows)), settings.max_new_tokens,
                                    target.max_seq_len)
  batch = batch_size or len(rows)
  if placement is not None and batch % placement.batch_size_multiple:
    multiple = placement.batch_size_multiple   # each batch shard holds its own rows
    progress(f'batch size {batch} rounded up to {-(-batch // multiple) * multiple}, a '
             f'multiple of the mesh batch axes ({multiple}); the prompts repeat')
    batch = -(-batch // multiple) * multiple
  prompt_BP, prompt_len_B = pad_prompts(rows, batch, min_width=width)
  graphdef, target_params = target.split()
  stop_ids = tuple(target.tokenizer.stop_ids)
  constrained = constrained_run(target, constraints, len(rows), verify_length, drafter,
                                forced_drafts)
  if placement:
    drafter_params = placement.put_params(drafter_params)
  if constrained:   # proposals verified whole: the host masks every step
    whole = 'tree' if 'tree' in verify_length else 'fixed'
    engine = speculative_engine(graphdef, drafter, spec, stop_ids, verify_length=whole,
                                trace=trace, tree=tree, placement=placement)
    progress('structured output: ' + ', '.join(sorted(
        {c.constraint.kind for c in constrained.compiled if c})) +
             (f'; verify_length={verify_length} verifies every '
              f'{"tree" if whole == "tree" else "proposal"} whole under a constraint'
              if verify_length.startswith('auto') else ''))
  else:
    engine = speculative_engine(graphdef, drafter, spec, stop_ids,
                                verify_length=verify_length, trace=trace,
                                controller=controller, placement=placement, tree=tree,
                                profiled=costs_lib.PROFILED)
  generations = [Generation(engine, target_params, drafter_params, constrained)]
  if compare_ar:   # the rounds rotate which generation runs first
    generations.insert(0, Generation(
        speculative_engine(graphdef, None, spec, stop_ids, placement=placement),
        target_params,
        constrained=constrained and dataclasses.replace(constrained, last=None)))
  progress(('decoding' if not settings.timing_repeats else
            f'decoding (warm-up + {settings.timing_repeats} timed runs)') +
           (', AR interleaved' if compare_ar else ''))
  with _transfer_guard(debug):
    *ar, run = timed_generations(generations, prompt_BP, prompt_len_B, settings, buffer_len)
  ar = ar[0] if ar else None
  state = run['state']
  ids = generated_ids(state)[:len(rows)]
  metrics = acceptance_metrics(state.stats)
  metrics.update(
      method=registry.name_of(drafter), temperature=settings.temperature,
      batch_size=int(prompt_BP.shape[0]), num_draft=int(drafter.num_draft),
      new_tokens=run['new_tokens'], tokens_per_s=run['tokens_per_s'],
      decode_s=run['decode_s'], ttft_s=run['prefill_s'], compile_s=run['compile_s'],
      verify_length=verify_length if 'tree' in verify_length else
      'auto' if engine.adaptive else 'fixed')
  if constrained:
    rows_run = constrained.last
    metrics.update(
        constraint_complete=rows_run.complete()[:len(rows)],
        constraint_host_ms_per_step=1e3 * rows_run.host_s / max(
            int(np.max(state.stats.steps_B)), 1))
  if 'tree' in verify_length:   # target positions scored per verify step (anchor included)
    metrics['nodes_verified_per_step'] = float(
        (np.sum(state.stats.proposed_B) + np.sum(state.stats.steps_B)) /
        max(int(np.sum(state.stats.steps_B)), 1))
  tiers = engine.row0_tiers
  if engine.adaptive:
    metrics['tier_steps'] = engine.tier_steps()
  if ar is not None:
    ar_ids = generated_ids(ar['state'])[:len(rows)]
    metrics.update(ar_tokens_per_s=ar['tokens_per_s'], ar_decode_s=ar['decode_s'],
                   speedup=ar['decode_s'] / run['decode_s'],
                   speedup_rounds=[a / r for a, r in zip(ar['decode_s_rounds'],
                                                         run['decode_s_rounds'])],
                   lossless=(ar_ids == ids) if spec.greedy else None)
  else:
    metrics.update(ar_tokens_per_s=None, speedup=None, speedup_rounds=None, lossless=None)
  per_prompt = [acceptance_metrics(state.stats, rows=[i]) for i in range(len(rows))]
  for m in per_prompt:
    m.pop('acceptance_lengths', None)
  return {
      'texts': [target.tokenizer.decode(r) for r in ids], 'ids': ids, 'metrics': metrics,
      'per_prompt': per_prompt,
      'trace': trace_of(state, tiers) if trace else None,
  }


def constrained_run(target: Target, constraints, num_rows: int, verify_length: str,
                    drafter, forced_drafts: bool) -> Optional[Constrained]:
  """The `Constrained` of a decode: `constraints` is one `Constraint` for every row, or one
  (or None) per prompt; None or all None: none. UserError before anything compiles for a
  constraint that does not compile, or a mode that cannot verify one."""
  from dspec.structured import Constraint, compile_constraint
  per_row = ([constraints] * num_rows if isinstance(constraints, Constraint)
             else list(constraints or [None] * num_rows))
  if len(per_row) != num_rows or not all(c is None or isinstance(c, Constraint)
                                         for c in per_row):
    raise UserError(f'constraints: one Constraint for every prompt, or a list of one '
                    f'Constraint (or None) per prompt ({num_rows}), got {constraints!r:.80}')
  if all(c is None for c in per_row):
    if getattr(drafter, 'needs_constraint', False):
      raise UserError('drafter grammar drafts only the tokens a constraint forces: give a '
                      'json_schema, regex or grammar')
    return None
  vocab = target.model.cfg.vocab_size
  stop_ids = tuple(target.tokenizer.stop_ids)
  compiled = {c: compile_constraint(c, target.tokenizer, vocab, stop_ids)
              for c in set(per_row) if c is not None}
  return Constrained(tuple(compiled.get(c) for c in per_row), vocab, forced_drafts)


def configured_prompts(cfg, prompts: Optional[Sequence] = None) -> list:
  """The prompts a decode config asks for: `prompts` when given, else
  `prompt_set[prompt_index]` when a prompt set is named, else `prompt`."""
  if prompts:
    return list(prompts)
  if not cfg.prompt_set:
    return [cfg.prompt]
  pool = datasets.load_prompts(cfg.prompt_set, cfg.data_dir)
  if not 0 <= cfg.prompt_index < len(pool):
    raise ValueError(f'prompt_index={cfg.prompt_index} is out of range for prompt set '
                     f'{cfg.prompt_set!r} ({len(pool)} prompts: 0..{len(pool) - 1})')
  return [pool[cfg.prompt_index]]


def run_decode(cfg, prompts: Optional[Sequence] = None, *, trace: bool = False,
               constraint=None, forced_drafts: bool = True,
               progress: Callable[[str], None] = lambda message: None) -> dict:
  """The decode job of a config: builds the target and drafter, decodes, compares with AR.
  constraint: a `dspec.structured.Constraint` for every prompt (structured output).

  With `cfg.mesh` set, params and decode state are sharded over that mesh and the same
  programs run with in/out shardings (the engines' `placement`); tokens equal the 1-device
  run.
  """
  config_checks.check_decode_config(cfg)   # every knob, before anything loads
  settings = Settings.from_config(cfg)
  controller = ControllerConfig.from_config(cfg.get('controller', {}))
  tree = TreeConfig.from_config(cfg.get('tree', {}))
  check_verify_length(cfg.verify_length)
  check_tree_fields(cfg.verify_length, cfg.drafter, cfg.drafters.get(cfg.drafter) or {})
  prompts = configured_prompts(cfg, prompts)
  if len(prompts) > cfg.batch_size:
    raise ValueError(f'{len(prompts)} prompts given but batch_size={cfg.batch_size}: '
                     f'raise --config.batch_size or give fewer prompts')
  placement = sharding.placement_from_config(cfg)
  progress('loading the target')
  model, tokenizer, max_seq_len = loading.build_target(cfg.model, placement)
  ratio = cfg.model.get('widen_mlp', 1)
  if ratio > 1:
    name = cfg.model.path or cfg.model.source
    num_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    progress(f'target: {name} widened {ratio}x in its MLPs: '
             f'{model.cfg.num_params() / 1e6:.1f}M params, {num_bytes / 1e6:.0f} MB '
             f'({model.cfg.param_dtype}), same tokens as {name}')
  placement = placement and placement.for_model(model.cfg)
  target = Target(model, tokenizer, max_seq_len)
  progress(f'building the {cfg.drafter} drafter')
  drafter, drafter_params = registry.build_drafter(cfg, model)
  out = decode(target, prompts, drafter, drafter_params, settings=settings,
               batch_size=cfg.batch_size, compare_ar=cfg.compare_ar,
               verify_length=cfg.verify_length, trace=trace, debug=cfg.debug,
               placement=placement, progress=progress, controller=controller, tree=tree,
               constraints=constraint, forced_drafts=forced_drafts)
  report = dict(out['metrics'])
  report.update(prompt=tokenizer.decode(_prompt_row(prompts[0], tokenizer)),
                output_ids=out['ids'][0], text=out['texts'][0])
  if trace:
    report['trace'] = out['trace']
  return report


def _prompt_row(prompt, tokenizer) -> list:
  return tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
