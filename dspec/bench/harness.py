"""The benchmark behind `scripts/benchmark.py` (docs/DESIGN.md): datasets × methods × sweep.

For every temperature × dataset × batch size, AR (the engine with no drafter) and every
method × size × verify length run over the dataset's prompts, in the same process. Each
batch of prompts gets one warm-up run per method (excluded from decode_s; summed into
compile_s: compilation and, for controller engines, the step-cost profiling of
`VerifyLengthController.profile`, which runs once per engine and batch size, in the first
warm-up) and then `timing_repeats` (>= 1) rounds in which AR and every method run the
batch once in turn, each method's median counting (`runner.timed_generations`): the
machine's drift falls on AR and the methods alike. Engines are built once per method ×
size × verify length × sampling spec and reused across datasets.

Verify length (`bench.verify_lengths`, empty: the config's `verify_length`), as the decode
CLI and the API choose it (`runner.speculative_engine`): 'auto' runs drafters under
the load-aware controller (tiers up to num_draft, tier 0 plain AR; host drafters such as
suffix too); 'fixed' verifies every proposal.
A method may be a variant (`bench.variants`): a label for a registry drafter with other
sub-config values (DFlash-2 checkpoints load through the `dflash` drafter). A method whose
checkpoint path is empty or not a directory is skipped with the reason (meta.json).

Row metrics:
  tau                token-weighted τ: committed tokens / verify steps over every prompt
                     (bonus included; AR = 1); tau_per_prompt_mean: the mean of per-prompt τ
  acceptance_rate,   `metrics.acceptance_metrics` over every step of every prompt
  per_position_acceptance (unconditional), tau_histogram (index n: steps committing n + 1)
  tokens_per_s       generated tokens of all prompts / their decode seconds (prefill excluded)
  speedup            tokens_per_s / ar_tokens_per_s. At T = 0 outputs equal AR's, so this is
                     AR decode time / method decode time over the same prompts; at T > 0 the
                     token-rate ratio accounts for different output lengths.
  speedup_rounds     the same ratio within each timed round (every batch's run in that round,
                     AR's in the same round; token counts of the last run): the spread that
                     the median-based speedup hides
  lossless_fraction  prompts whose greedy output is token-identical to AR's (T = 0); null at T > 0
  sol_bound          T > 0: `sol.sol_bound` with P = num_draft + 1 and the dataset's entropy
                     at that temperature (None for drafters that sample their proposals)
  greedy_oracle_ceiling  T = 0: the τ of an oracle proposing AR's own output (`sol.py`)
  verify_length      'auto' | 'fixed' (None for AR)
  tier_steps         auto: {tier: verify steps summed over the rows of every batch} of the
                     last timed run of each batch (filler rows of a last partial batch
                     included). None in fixed mode and for AR.
                     Under auto, tau and the acceptance curves pool every tier's steps
                     (a tier-γ step cannot accept past position γ; tier 0 accepts nothing).
  draft_over_verify  with `bench.draft_cost_repeats` > 0: `draft_cost.draft_vs_verify` (draft
                     pass + update over one verify pass of num_draft + 1 tokens), measured once
                     per method × size × batch size on the first batch of the first dataset
                     (None for host drafters and AR)
Suffix decoding gets a private global trie per (dataset, temperature, batch size, size,
verify length) (`host_drafter_factory(private=True)`) that persists across that run's
prompts: later prompts draft from earlier prompts' outputs, never from their own (the
timing-honesty rule of drafters/suffix.py). A last batch with fewer prompts than the batch
size is filled with repeats, which count in time, not tokens.
With `bench.hf_peer`, `hf_peer.time_hf_generate` times transformers on the first
`bench.hf.num_prompts` prompts of `bench.hf.dataset`; the dspec side of every ratio comes
from the same prompts at T = 0, batch 1 (AR, and the method × size with the best tokens/s).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from types import SimpleNamespace
from typing import Callable, Optional, Sequence

import numpy as np
from flax import nnx
from tqdm import tqdm

from dspec import compiled_programs, datasets, loading
from dspec.bench import draft_cost, hf_peer, report, sol
from dspec.errors import UserError
from dspec.decoding import drafter as drafter_lib
from dspec.decoding import runner
from dspec.decoding.drafters import registry
from dspec.decoding.policy import ControllerConfig
from dspec.decoding.prompts import encode_prompts, generated_ids, pad_prompts
from dspec.decoding.tree_engine import TreeConfig
from dspec.metrics import acceptance_metrics, distinct_ngram_ratio
_STAT_FIELDS = ('steps_B', 'committed_B', 'accept_hist_BG1', 'proposed_B', 'accepted_B',
                'reached_BG', 'passed_BG')


def load_dataset(name: str, data_dir: str, limit: int) -> list:
  """Prompt strings of a prompt set (`datasets.PROMPT_SETS`); missing packages are
  user errors."""
  try:
    return datasets.load_prompts(name, data_dir, limit)
  except ImportError as e:
    raise UserError(str(e)) from e


@dataclasses.dataclass
class Batch:
  prompt_BP: np.ndarray   # padded to a multiple of the prompt bucket
  lens: np.ndarray
  rows: int               # real prompts; rows beyond repeat them to fill the batch


def make_batches(ids: list, batch_size: int, tokenizer, vocab_size: int, max_seq_len: int,
                 max_new_tokens: int, bucket: int) -> list:
  batches = []
  for start in range(0, len(ids), batch_size):
    chunk = encode_prompts(ids[start:start + batch_size], tokenizer, vocab_size,
                           max_seq_len, max_new_tokens)
    prompt_BP, lens = pad_prompts(chunk, batch_size, width_multiple=bucket)
    batches.append(Batch(prompt_BP, lens, len(chunk)))
  return batches


@dataclasses.dataclass
class RunResult:
  """One method × size × verify length over every batch of a dataset (per-batch timings)."""

  num_draft: int
  samples_proposals: bool = False
  verify_length: Optional[str] = None
  tier_steps: Optional[dict] = None
  decode_s: list = dataclasses.field(default_factory=list)
  decode_s_rounds: list = dataclasses.field(default_factory=list)   # per batch, per round
  new_tokens: list = dataclasses.field(default_factory=list)
  outputs: list = dataclasses.field(default_factory=list)
  stats: list = dataclasses.field(default_factory=list)
  compile_s: float = 0.0

  def tokens_per_s(self, num_batches: Optional[int] = None) -> float:
    return hf_peer.tokens_per_s(self.decode_s[:num_batches], self.new_tokens[:num_batches])

  def tokens_per_s_rounds(self) -> list:
    """Tokens per second of each timed round (every batch's run in that round)."""
    return [hf_peer.tokens_per_s(list(times), self.new_tokens)
            for times in zip(*self.decode_s_rounds)]

  def metrics(self) -> dict:
    merged = {f: np.concatenate([s[f] for s in self.stats]) for f in _STAT_FIELDS}
    return acceptance_metrics(SimpleNamespace(**merged))

  def add_tier_steps(self, steps: dict) -> None:
    for g, n in steps.items():
      self.tier_steps[int(g)] = self.tier_steps.get(int(g), 0) + int(n)


@dataclasses.dataclass
class Engines:
  """What one method × size × verify length runs on (a controller under auto)."""

  engine: object
  verify_length: Optional[str] = None       # None: AR


def run_batches(runs: Sequence[tuple], target_params, batches: list,
                settings: runner.Settings, on_ar_state: Callable, tick: Callable) -> list:
  """Times every batch with every run (engines, drafter params, host drafter factory; the
  first is AR's) in one `runner.timed_generations`: the runs take turns in each round, so
  the machine's drift falls on AR and the methods alike. One RunResult per run, with the
  real rows' results and, under auto, the tier steps of each batch's last (timed) run.
  `on_ar_state(i, state, batch)` sees AR's state of batch i."""
  results, generations = [], []
  for engines, drafter_params, host_factory in runs:
    engine = engines.engine
    result = RunResult(engine.num_draft, engine.drafter.samples_proposals,
                       engines.verify_length)
    if engine.adaptive:
      result.tier_steps = {}
    if host_factory is not None:   # this run's own cross-request cache
      engine.host.use_factory(host_factory)
    results.append(result)
    generations.append(runner.Generation(engine, target_params, drafter_params))
  for i, batch in enumerate(batches):
    timed = runner.timed_generations(generations, batch.prompt_BP, batch.lens, settings)
    for (engines, _, _), result, run in zip(runs, results, timed):
      _record(result, engines, run, batch.rows)
    on_ar_state(i, timed[0]['state'], batch)
    tick(len(runs))
  return results


def _record(result: RunResult, engines: Engines, timed: dict, rows: int) -> None:
  """Adds one batch's timed generation (its first `rows` rows) to `result`."""
  state, engine = timed['state'], engines.engine
  generated = np.asarray(state.num_tokens_B) - np.asarray(state.prompt_len_B)
  result.decode_s.append(timed['decode_s'])
  result.decode_s_rounds.append(timed['decode_s_rounds'])
  result.new_tokens.append(int(generated[:rows].sum()))
  result.outputs += generated_ids(state)[:rows]
  result.stats.append({f: np.asarray(getattr(state.stats, f))[:rows] for f in _STAT_FIELDS})
  result.compile_s += timed['compile_s']
  if engine.adaptive:
    result.add_tier_steps(engine.tier_steps())


def verify_lengths(cfg) -> tuple:
  """The verify lengths the sweep runs: `bench.verify_lengths`, else the config's."""
  return tuple(cfg.bench.verify_lengths) or (cfg.verify_length,)


def _variant(cfg, method: str) -> tuple:
  """(registry drafter, {sub-config overrides}) of a bench method (`bench.variants`)."""
  variant = cfg.bench.variants.get(method)
  if variant is None:
    return method, {}
  overrides = variant.to_dict()
  return overrides.pop('drafter'), overrides


def run_config(cfg, method: str, temperature: float = 0.0, batch_size: int = 1,
               size: Optional[int] = None):
  """A copy of `cfg` set up for one run of the sweep (a variant's values applied)."""
  c = copy.deepcopy(cfg)
  drafter, overrides = _variant(cfg, method)
  c.drafter, c.temperature, c.batch_size = drafter, float(temperature), int(batch_size)
  if overrides:
    c.drafters[drafter].update(overrides)
  if size is not None:
    c.drafters[drafter].num_draft = int(size)
  return c


def plan_methods(cfg) -> tuple:
  """([(method, size or None)], {skipped method: reason}) from `bench.methods`. A method
  whose checkpoint path is empty or not a directory is skipped, with the reason. Sizes:
  `bench.method_sizes` of the method, else of its registry drafter (a variant), else
  `bench.sizes`."""
  bench, plan, skipped = cfg.bench, [], {}
  for method in bench.methods:
    if method in ('ar', 'none'):
      continue
    drafter, _ = _variant(cfg, method)
    if drafter not in registry.known() or drafter == 'none':
      raise UserError(f'unknown bench method {method!r}; known: ar, '
                      f'{", ".join(m for m in registry.known() if m != "none")}, '
                      f'and the variants in bench.variants')
    sub = run_config(cfg, method).drafters.get(drafter)
    if sub is not None and 'path' in sub:
      if not sub.path:
        skipped[method] = f'no checkpoint: drafters.{drafter}.path is empty'
        continue
      if not os.path.isdir(sub.path):
        skipped[method] = f'no checkpoint: {sub.path} does not exist'
        continue
    sizes = bench.method_sizes.get(method, bench.method_sizes.get(drafter, bench.sizes))
    plan += [(method, int(s)) for s in sizes]
  return plan, skipped


def validate(cfg) -> None:
  bench = cfg.bench
  for name in ('datasets', 'temperatures', 'batch_sizes'):
    if not bench[name]:
      raise UserError(f'bench.{name} is empty')
  if bench.num_prompts < 1:
    raise UserError(f'bench.num_prompts must be >= 1, got {bench.num_prompts}')
  if bench.prompt_bucket < 1:
    raise UserError(f'bench.prompt_bucket must be >= 1, got {bench.prompt_bucket}')
  if cfg.timing_repeats < 1:
    raise UserError(f'the benchmark needs timing_repeats >= 1 (the warm-up run compiles and '
                    f'profiles, and is not timed), got {cfg.timing_repeats}')
  for vl in verify_lengths(cfg):
    if vl not in runner.VERIFY_LENGTHS:
      raise UserError(f'verify length must be one of {runner.VERIFY_LENGTHS}, got {vl!r}')
  for method, variant in bench.variants.items():
    if 'drafter' not in variant or variant.drafter not in cfg.drafters:
      raise UserError(f'bench.variants.{method} needs drafter: one of the drafters '
                      f'({", ".join(cfg.drafters)})')
  for t in bench.temperatures:
    runner.Settings.from_config(run_config(cfg, 'none', t, min(bench.batch_sizes)))
  if bench.hf_peer:
    hf = bench.hf
    if hf.dataset not in bench.datasets or 0.0 not in bench.temperatures \
        or 1 not in bench.batch_sizes:
      raise UserError('bench.hf_peer needs bench.hf.dataset in bench.datasets, temperature 0 '
                      'and batch size 1 in the sweep')
    if not 1 <= hf.num_prompts <= bench.num_prompts:
      raise UserError(f'bench.hf.num_prompts must be in [1, bench.num_prompts], '
                      f'got {hf.num_prompts}')


def _row(dataset, method, temperature, batch_size, size, res: RunResult, ar: RunResult,
         entropy: Optional[dict], max_new_tokens: int, cost: Optional[dict] = None) -> dict:
  metrics = res.metrics()
  tps, ar_tps = res.tokens_per_s(), ar.tokens_per_s()
  lossless = (None if temperature > 0 else
              float(np.mean([o == a for o, a in zip(res.outputs, ar.outputs)])))
  width = res.num_draft + 1
  return {
      'engine': 'dspec', 'dataset': dataset, 'method': method,
      'temperature': float(temperature), 'batch_size': int(batch_size),
      'num_draft': res.num_draft, 'verify_length': res.verify_length,
      'tier_steps': res.tier_steps, 'tau': metrics['tau'],
      'tau_per_prompt_mean': metrics['tau_per_prompt_mean'],
      'acceptance_rate': metrics['acceptance_rate'],
      'per_position_acceptance': metrics['per_position_acceptance'],
      'per_position_acceptance_conditional': metrics['per_position_acceptance_conditional'],
      'tau_histogram': metrics['tau_histogram'], 'verify_steps': metrics['verify_steps'],
      'position_reached': metrics['position_reached'],
      'position_passed': metrics['position_passed'],
      'speedup': tps / ar_tps, 'tokens_per_s': tps, 'ar_tokens_per_s': ar_tps,
      'speedup_rounds': [t / a for t, a in zip(res.tokens_per_s_rounds(),
                                                ar.tokens_per_s_rounds())],
      'decode_s': float(np.sum(res.decode_s)), 'new_tokens': int(np.sum(res.new_tokens)),
      'lossless_fraction': lossless,
      'draft_over_verify': cost['draft_over_verify'] if cost else None,
      **sol.speed_of_light(temperature, width, entropy, ar.outputs,
                           sampled_proposals=res.samples_proposals),
      'entropy_mu': entropy['entropy_mu'] if entropy else None,
      'num_prompts': len(res.outputs), 'max_new_tokens': int(max_new_tokens),
      'compile_s': res.compile_s,
  }


class Benchmark:
  """One benchmark run: the target, the built drafters and the results so far."""

  def __init__(self, cfg, out_dir: str, command: str = ''):
    validate(cfg)
    self.cfg, self.bench, self.out_dir, self.command = cfg, cfg.bench, out_dir, command
    self.target, self.tokenizer, self.max_seq_len = loading.build_target(cfg.model)
    self.graphdef, self.params = nnx.split(self.target)
    self.stop_ids = tuple(self.tokenizer.stop_ids)
    # The decode config's controller knobs and tree shape, as the CLI and the API take them.
    self.controller = ControllerConfig.from_config(cfg.get('controller', {}))
    self.tree = TreeConfig.from_config(cfg.tree) if 'tree' in cfg else TreeConfig()
    self.plan, self.skipped = plan_methods(cfg)
    self.drafters = {}   # built once (checkpoints load once, bad ones fail before timing)
    for method, size in self.plan:
      self.drafters[method, size] = registry.build_drafter(
          run_config(cfg, method, size=size), self.target)
    self.prompts = {}
    for name in self.bench.datasets:
      texts = load_dataset(name, cfg.data_dir, self.bench.num_prompts)
      if not texts:
        raise UserError(f'dataset {name!r} has no prompts')
      ids = [self.tokenizer.encode(t) for t in texts]
      if self.bench.max_prompt_tokens > 0:
        ids = [row[-self.bench.max_prompt_tokens:] for row in ids]
      self.prompts[name] = ids
    longest = max((int(d.num_draft), m) for (m, _), (d, _) in self.drafters.items()) \
        if self.drafters else (0, 'ar')
    for name, ids in self.prompts.items():   # before anything compiles
      encode_prompts(ids, self.tokenizer, self.target.cfg.vocab_size, self.max_seq_len,
                     cfg.max_new_tokens, longest[0], f'bench method {longest[1]} size')
    self.verify_lengths = verify_lengths(cfg)
    self.rows, self.entropy, self.peer_runs = [], {}, {}
    self.engines, self.draft_costs = {}, {}

  def point_units(self, dataset: str, batch_size: int) -> int:
    """Progress units of one sweep point: its batches × (AR + every method run)."""
    runs = 1 + len(self.plan) * len(self.verify_lengths)
    return -(-len(self.prompts[dataset]) // batch_size) * runs

  def num_units(self) -> int:
    hf = 3 * self.bench.hf.num_prompts if self.bench.hf_peer else 0
    return len(self.bench.temperatures) * sum(
        self.point_units(d, b) for d in self.prompts for b in self.bench.batch_sizes) + hf

  def _engines(self, key, drafter, settings: runner.Settings,
               verify_length: Optional[str]) -> Engines:
    """The engines of one method × size × verify length at these sampling settings, built
    once (compiled programs, the controller's step-cost table) and reused across datasets."""
    spec = settings.sampling()
    if (key, verify_length, spec) not in self.engines:
      engine = runner.speculative_engine(self.graphdef, drafter, spec, self.stop_ids,
                                         verify_length=verify_length or 'fixed',
                                         controller=self.controller, tree=self.tree)
      self.engines[key, verify_length, spec] = Engines(engine, verify_length)
    return self.engines[key, verify_length, spec]

  def _draft_cost(self, key, drafter, params, settings: runner.Settings,
                  batch: Batch) -> Optional[dict]:
    """`draft_cost.draft_vs_verify` of a device drafter, once per method × size × batch size
    (on `batch` prefilled), with `bench.draft_cost_repeats` > 0."""
    repeats, b = self.bench.draft_cost_repeats, batch.prompt_BP.shape[0]
    if repeats < 1 or drafter_lib.host_drafter_factory(drafter):
      return None
    if (key, b) not in self.draft_costs:
      engine = runner.speculative_engine(self.graphdef, drafter, settings.sampling(),
                                         self.stop_ids, verify_length='fixed')
      state = engine.prefill(self.params, params, batch.prompt_BP, batch.lens,
                             temperature=settings.temperature, top_p=settings.top_p,
                             max_new_tokens=settings.max_new_tokens, seed=settings.seed)
      self.draft_costs[key, b] = draft_cost.draft_vs_verify(engine, self.params, params,
                                                            state, repeats)
    return self.draft_costs[key, b]

  def run_sweep_point(self, dataset: str, temperature: float, batch_size: int,
                      bar: tqdm) -> None:
    """AR and every planned method × size × verify length (timed in turns, `run_batches`)
    over one dataset at one T and batch size."""
    cfg = self.cfg
    batches = make_batches(self.prompts[dataset], batch_size, self.tokenizer,
                           self.target.cfg.vocab_size, self.max_seq_len, cfg.max_new_tokens,
                           self.bench.prompt_bucket)
    settings = runner.Settings.from_config(run_config(cfg, 'none', temperature, batch_size))
    meter = None
    if temperature > 0 and (dataset, temperature) not in self.entropy:
      meter = sol.EntropyMeter(self.graphdef, self.params, temperature, cfg.top_k, cfg.top_p)
    def on_ar_state(i, state, batch):
      if meter is not None:
        meter.add(state, batch.rows)

    keys, runs = ['ar'], [(self._engines('ar', drafter_lib.NoDrafter(), settings, None),
                           None, None)]
    costs = {}
    for method, size in self.plan:
      drafter, params = self.drafters[method, size]
      costs[method, size] = self._draft_cost((method, size), drafter, params, settings,
                                             batches[0])
      for vl in self.verify_lengths:
        if vl in ('tree', 'auto_tree') and isinstance(drafter, drafter_lib.HostProposing):
          self.skipped[f'{method} {vl}'] = 'a host-side drafter has no tree mode'
          continue
        keys.append((method, size, vl))
        runs.append((self._engines((method, size), drafter, settings, vl), params,
                     drafter_lib.host_drafter_factory(drafter, private=True)))
    bar.set_postfix_str(f'{dataset} T={temperature:g} b={batch_size}: AR and '
                        f'{len(runs) - 1} runs')
    runs = dict(zip(keys, run_batches(runs, self.params, batches, settings, on_ar_state,
                                      bar.update)))
    ar = runs['ar']
    if meter is not None:
      self.entropy[dataset, temperature] = meter.moments()
    entropy = self.entropy.get((dataset, temperature))
    args = (temperature, batch_size)
    ar_row = _row(dataset, 'ar', *args, None, ar, ar, entropy, cfg.max_new_tokens)
    ar_row.update(distinct_4=distinct_ngram_ratio(ar.outputs, 4),
                  sample=self.tokenizer.decode(ar.outputs[0]))
    self.rows.append(ar_row)
    for key in keys[1:]:
      method, size, _ = key
      self.rows.append(_row(dataset, method, *args, size, runs[key], ar, entropy,
                            cfg.max_new_tokens, costs[method, size]))
    if self.bench.hf_peer and (dataset, temperature, batch_size) == (
        self.bench.hf.dataset, 0.0, 1):
      self.peer_runs = runs

  def run_peer(self, bar: tqdm) -> dict:
    """Times HF generate; appends its rows; returns the dspec/HF summary."""
    hf_cfg, n = self.bench.hf, self.bench.hf.num_prompts
    prompts = self.prompts[hf_cfg.dataset][:n]
    bar.set_postfix_str(f'{hf_cfg.dataset} transformers')
    runs, threads = hf_peer.time_hf_generate(
        self.target, prompts, self.cfg.max_new_tokens, self.stop_ids, hf_cfg,
        max(1, self.cfg.timing_repeats), lambda method: bar.update())
    ar = self.peer_runs['ar']
    dspec_ar_tps = ar.tokens_per_s(n)
    spec = {k: v for k, v in self.peer_runs.items() if k != 'ar'}
    best_key = max(spec, key=lambda k: spec[k].tokens_per_s(n)) if spec else None
    dspec_best_tps = spec[best_key].tokens_per_s(n) if spec else None
    hf_tps = {m: hf_peer.tokens_per_s(r['decode_s'], r['new_tokens']) for m, r in runs.items()}
    hf_best = max(('hf_prompt_lookup', 'hf_assisted'), key=hf_tps.get)
    ar_outputs = ar.outputs[:n]
    for method, r in runs.items():
      reference = ar_outputs if method == 'hf_ar' else runs['hf_ar']['outputs']
      counterpart = dspec_ar_tps if method == 'hf_ar' else dspec_best_tps
      self.rows.append({
          'engine': 'transformers', 'dataset': hf_cfg.dataset, 'method': method,
          'temperature': 0.0, 'batch_size': 1,
          'num_draft': {'hf_ar': 0, 'hf_prompt_lookup': hf_cfg.prompt_lookup_num_tokens,
                        'hf_assisted': hf_cfg.num_assistant_tokens}[method],
          'tau': None, 'per_position_acceptance': [], 'tau_histogram': [],
          'speedup': hf_tps[method] / hf_tps['hf_ar'], 'tokens_per_s': hf_tps[method],
          'ar_tokens_per_s': hf_tps['hf_ar'],
          'lossless_fraction': float(np.mean([a == b for a, b in
                                              zip(r['outputs'], reference)])),
          'sol_bound': None, 'num_prompts': n, 'max_new_tokens': self.cfg.max_new_tokens,
          'dspec_tokens_per_s': counterpart,
          'dspec_over_hf': None if counterpart is None else counterpart / hf_tps[method],
      })
    dspec_best_speedup = None if best_key is None else dspec_best_tps / dspec_ar_tps
    hf_best_speedup = hf_tps[hf_best] / hf_tps['hf_ar']
    return {
        'dataset': hf_cfg.dataset, 'num_prompts': n, 'torch_threads': threads,
        'assistant': f'the target truncated to its first {hf_cfg.assistant_layers} layers, '
                     f'{hf_cfg.num_assistant_tokens} tokens, '
                     f'{hf_cfg.num_assistant_tokens_schedule} schedule, confidence threshold '
                     f'{hf_cfg.assistant_confidence_threshold}',
        'dspec_ar_tokens_per_s': dspec_ar_tps, 'hf_ar_tokens_per_s': hf_tps['hf_ar'],
        'ar_ratio': dspec_ar_tps / hf_tps['hf_ar'],
        'dspec_best': None if best_key is None else
        {'method': best_key[0], 'num_draft': spec[best_key].num_draft,
         'verify_length': best_key[2], 'tokens_per_s': dspec_best_tps,
         'speedup': dspec_best_speedup},
        'hf_best': {'method': hf_best, 'tokens_per_s': hf_tps[hf_best],
                    'speedup': hf_best_speedup},
        'best_tokens_per_s_ratio': None if best_key is None else dspec_best_tps / hf_tps[hf_best],
        'best_speedup_ratio': None if best_key is None else dspec_best_speedup / hf_best_speedup,
        'goal_ar': dspec_ar_tps >= hf_tps['hf_ar'],
        'goal_speculative': best_key is not None and dspec_best_speedup >= 2 * hf_best_speedup,
    }

  def _progress(self, wall_s: float) -> dict:
    """What `resume` needs: the config, the finished sweep points' rows, the entropy and
    draft-cost measurements, the wall time so far."""
    return {'config': report.json_ready(self.cfg.to_dict()), 'rows': self.rows,
            'wall_s': wall_s, 'draft_cost': self._draft_cost_list(),
            'entropy': self._entropy_list()}

  def _entropy_list(self) -> list:
    return [{'dataset': d, 'temperature': t, **e} for (d, t), e in self.entropy.items()]

  def _draft_cost_list(self) -> list:
    return [{'method': m, 'num_draft': size, 'batch_size': b, **c}
            for ((m, size), b), c in self.draft_costs.items()]

  def resume(self) -> float:
    """Loads `out_dir`'s partial results of an interrupted run of this same config: its
    finished sweep points are not run again. Returns their wall time (0 without any)."""
    path = os.path.join(self.out_dir, report.PARTIAL)
    if not os.path.exists(path):
      return 0.0
    saved = report.read_partial(path)
    now = report.json_ready(self.cfg.to_dict())
    if saved['config'] != now:
      differ = sorted(k for k in set(now) | set(saved['config'])
                      if now.get(k) != saved['config'].get(k))
      raise UserError(f'{path} was written with another config (differs in: '
                      f'{", ".join(differ)}); rerun with that config or without --resume')
    self.rows = saved['rows']
    self.entropy = {(e.pop('dataset'), e.pop('temperature')): e for e in saved['entropy']}
    self.draft_costs = {((c.pop('method'), c.pop('num_draft')), c.pop('batch_size')): c
                        for c in saved['draft_cost']}
    return float(saved['wall_s'])

  def done_points(self) -> set:
    """(dataset, temperature, batch size) of the sweep points whose rows are in."""
    return {(r['dataset'], r['temperature'], r['batch_size']) for r in self.rows
            if r.get('engine', 'dspec') == 'dspec' and r['method'] == 'ar'}

  def run(self, resume: bool = False) -> list:
    """The whole sweep (+ peer); writes every output under `out_dir`; returns the rows.
    `resume`: continue an interrupted run of the same config from its partial results."""
    started = time.time()
    earlier_s = self.resume() if resume else 0.0
    done = self.done_points()
    report.remove_stale(self.out_dir, keep_partial=resume)
    bench, peer = self.bench, None
    with tqdm(total=self.num_units(), desc='benchmark', unit='run', dynamic_ncols=True) as bar:
      for temperature in bench.temperatures:   # outermost: one sampling spec's programs
        for dataset in bench.datasets:          # at a time stay in the engine cache
          for batch_size in bench.batch_sizes:
            if (dataset, float(temperature), int(batch_size)) in done:
              bar.update(self.point_units(dataset, batch_size))
              continue
            self.run_sweep_point(dataset, float(temperature), int(batch_size), bar)
            compiled_programs.release_if_many_maps()   # a family run compiles hundreds
            report.write_partial(self.out_dir,
                                 self._progress(earlier_s + time.time() - started))
      if bench.hf_peer:
        peer = self.run_peer(bar)
    meta = report.run_metadata(self.cfg, self.command, earlier_s + time.time() - started)
    meta.update(skipped=self.skipped, peer=peer, verify_lengths=list(self.verify_lengths),
                draft_cost=self._draft_cost_list(), resumed=bool(done),
                entropy=self._entropy_list())
    report.write_outputs(self.out_dir, self.rows, meta)
    return self.rows


def run_benchmark(cfg, out_dir: str, command: str = '', resume: bool = False) -> list:
  """Runs the configured benchmark into `out_dir` (results.json, results.md, plots);
  `resume` continues an interrupted run of the same config there."""
  return Benchmark(cfg, out_dir, command).run(resume)
