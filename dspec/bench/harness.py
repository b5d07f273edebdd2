"""The benchmark behind `scripts/benchmark.py` (DESIGN §8, §9): datasets × methods × sweep.

For every dataset × temperature × batch size, AR (the engine with no drafter) runs over the
dataset's prompts, then every method × size over the same prompts, in the same process.
Each batch of prompts gets one warm-up run (compilation; excluded, summed into compile_s)
and then `timing_repeats` timed runs whose median counts (`runner.timed_generation`).

Row metrics:
  tau                token-weighted τ: committed tokens / verify steps over every prompt
                     (bonus included; AR = 1); tau_per_prompt_mean: the mean of per-prompt τ
  acceptance_rate,   `metrics.acceptance_metrics` over every step of every prompt
  per_position_acceptance (unconditional), tau_histogram (index n: steps committing n + 1)
  tokens_per_s       generated tokens of all prompts / their decode seconds (prefill excluded)
  speedup            tokens_per_s / ar_tokens_per_s. At T = 0 outputs equal AR's, so this is
                     AR decode time / method decode time over the same prompts; at T > 0 the
                     token-rate ratio accounts for different output lengths.
  lossless_fraction  prompts whose greedy output is token-identical to AR's (T = 0); null at T > 0
  sol_bound          T > 0: `sol.sol_bound` with P = num_draft + 1 and the dataset's entropy
                     at that temperature (None for drafters that sample their proposals)
  greedy_oracle_ceiling  T = 0: the τ of an oracle proposing AR's own output (`sol.py`)
Suffix decoding gets a private global trie per (dataset, temperature, batch size, size)
(`host_drafter_factory(private=True)`) that persists across that run's prompts: later prompts draft from earlier prompts' outputs,
never from their own (the timing-honesty rule of drafters/suffix.py). A last batch with
fewer prompts than the batch size is filled with repeats, which count in time, not tokens.
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
from typing import Callable, Optional

import numpy as np
from flax import nnx
from tqdm import tqdm

from dspec import datasets, loading
from dspec.bench import hf_peer, report, sol
from dspec.cli import UserError
from dspec.decoding import drafter as drafter_lib
from dspec.decoding import runner
from dspec.decoding.drafters import registry
from dspec.decoding.engine import SpeculativeEngine
from dspec.decoding.prompts import encode_prompts, generated_ids, pad_prompts
from dspec.metrics import acceptance_metrics, distinct_ngram_ratio
_STAT_FIELDS = ('steps_B', 'committed_B', 'accept_hist_BG1', 'proposed_B', 'accepted_B')


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
  """One method × size over every batch of a dataset (per-batch timings kept)."""

  num_draft: int
  samples_proposals: bool = False
  decode_s: list = dataclasses.field(default_factory=list)
  new_tokens: list = dataclasses.field(default_factory=list)
  outputs: list = dataclasses.field(default_factory=list)
  stats: list = dataclasses.field(default_factory=list)
  compile_s: float = 0.0

  def tokens_per_s(self, num_batches: Optional[int] = None) -> float:
    return hf_peer.tokens_per_s(self.decode_s[:num_batches], self.new_tokens[:num_batches])

  def metrics(self) -> dict:
    merged = {f: np.concatenate([s[f] for s in self.stats]) for f in _STAT_FIELDS}
    return acceptance_metrics(SimpleNamespace(**merged))


def run_batches(engine, target_params, batches: list, settings: runner.Settings,
                drafter_params, host_factory, on_state: Callable, tick: Callable) -> RunResult:
  """Times every batch (`runner.timed_generation`); keeps the real rows' results."""
  result = RunResult(engine.num_draft, engine.drafter.samples_proposals)
  for i, batch in enumerate(batches):
    timed = runner.timed_generation(engine, target_params, drafter_params, batch.prompt_BP,
                                    batch.lens, settings, host_factory)
    state, n = timed['state'], batch.rows
    generated = np.asarray(state.num_tokens_B) - np.asarray(state.prompt_len_B)
    result.decode_s.append(timed['decode_s'])
    result.new_tokens.append(int(generated[:n].sum()))
    result.outputs += generated_ids(state)[:n]
    result.stats.append({f: np.asarray(getattr(state.stats, f))[:n] for f in _STAT_FIELDS})
    result.compile_s += timed['compile_s']
    on_state(i, state, batch)
    tick()
  return result


def run_config(cfg, method: str, temperature: float = 0.0, batch_size: int = 1,
               size: Optional[int] = None):
  """A copy of `cfg` set up for one run of the sweep."""
  c = copy.deepcopy(cfg)
  c.drafter, c.temperature, c.batch_size = method, float(temperature), int(batch_size)
  if size is not None:
    c.drafters[method].num_draft = int(size)
  return c


def plan_methods(cfg) -> tuple:
  """([(method, size or None)], {skipped method: reason}) from `bench.methods`."""
  bench, plan, skipped = cfg.bench, [], {}
  for method in bench.methods:
    if method in ('ar', 'none'):
      continue
    if method not in registry.known():
      raise UserError(f'unknown bench method {method!r}; known: ar, '
                      f'{", ".join(m for m in registry.known() if m != "none")}')
    sub = cfg.drafters.get(method)
    if sub is not None and 'path' in sub and not sub.path:
      skipped[method] = f'no checkpoint: drafters.{method}.path is empty'
      continue
    plan += [(method, int(s)) for s in bench.method_sizes.get(method, bench.sizes)]
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
         entropy: Optional[dict], max_new_tokens: int) -> dict:
  metrics = res.metrics()
  tps, ar_tps = res.tokens_per_s(), ar.tokens_per_s()
  lossless = (None if temperature > 0 else
              float(np.mean([o == a for o, a in zip(res.outputs, ar.outputs)])))
  width = res.num_draft + 1
  return {
      'engine': 'dspec', 'dataset': dataset, 'method': method,
      'temperature': float(temperature), 'batch_size': int(batch_size),
      'num_draft': res.num_draft, 'tau': metrics['tau'],
      'tau_per_prompt_mean': metrics['tau_per_prompt_mean'],
      'acceptance_rate': metrics['acceptance_rate'],
      'per_position_acceptance': metrics['per_position_acceptance'],
      'per_position_acceptance_conditional': metrics['per_position_acceptance_conditional'],
      'tau_histogram': metrics['tau_histogram'], 'verify_steps': metrics['verify_steps'],
      'speedup': tps / ar_tps, 'tokens_per_s': tps, 'ar_tokens_per_s': ar_tps,
      'decode_s': float(np.sum(res.decode_s)), 'new_tokens': int(np.sum(res.new_tokens)),
      'lossless_fraction': lossless,
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
    self.rows, self.entropy, self.peer_runs = [], {}, {}

  def num_units(self) -> int:
    per_batch = sum(-(-len(ids) // b) for ids in self.prompts.values()
                    for b in self.bench.batch_sizes)
    hf = 3 * self.bench.hf.num_prompts if self.bench.hf_peer else 0
    return per_batch * len(self.bench.temperatures) * (1 + len(self.plan)) + hf

  def _engine(self, drafter, settings: runner.Settings) -> SpeculativeEngine:
    return SpeculativeEngine(self.graphdef, drafter=drafter, sampling=settings.sampling(),
                             stop_ids=self.stop_ids)

  def run_sweep_point(self, dataset: str, temperature: float, batch_size: int,
                      bar: tqdm) -> None:
    """AR, then every planned method × size, over one dataset at one T and batch size."""
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

    bar.set_postfix_str(f'{dataset} T={temperature:g} b={batch_size} ar')
    ar = run_batches(self._engine(drafter_lib.NoDrafter(), settings), self.params, batches,
                     settings, None, None, on_ar_state, bar.update)
    if meter is not None:
      self.entropy[dataset, temperature] = meter.moments()
    entropy = self.entropy.get((dataset, temperature))
    args = (temperature, batch_size)
    ar_row = _row(dataset, 'ar', *args, None, ar, ar, entropy, cfg.max_new_tokens)
    ar_row.update(distinct_4=distinct_ngram_ratio(ar.outputs, 4),
                  sample=self.tokenizer.decode(ar.outputs[0]))
    self.rows.append(ar_row)
    runs = {'ar': ar}
    for method, size in self.plan:
      drafter, params = self.drafters[method, size]
      bar.set_postfix_str(f'{dataset} T={temperature:g} b={batch_size} {method}:{size}')
      res = run_batches(self._engine(drafter, settings), self.params, batches, settings,
                        params, drafter_lib.host_drafter_factory(drafter, private=True),
                        lambda *a: None, bar.update)
      self.rows.append(_row(dataset, method, *args, size, res, ar, entropy,
                            cfg.max_new_tokens))
      runs[method, size] = res
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
        {'method': best_key[0], 'num_draft': best_key[1], 'tokens_per_s': dspec_best_tps,
         'speedup': dspec_best_speedup},
        'hf_best': {'method': hf_best, 'tokens_per_s': hf_tps[hf_best],
                    'speedup': hf_best_speedup},
        'best_tokens_per_s_ratio': None if best_key is None else dspec_best_tps / hf_tps[hf_best],
        'best_speedup_ratio': None if best_key is None else dspec_best_speedup / hf_best_speedup,
        'goal_ar': dspec_ar_tps >= hf_tps['hf_ar'],
        'goal_speculative': best_key is not None and dspec_best_speedup >= 2 * hf_best_speedup,
    }

  def run(self) -> list:
    """The whole sweep (+ peer); writes every output under `out_dir`; returns the rows."""
    started = time.time()
    report.remove_stale(self.out_dir)
    bench, peer = self.bench, None
    with tqdm(total=self.num_units(), desc='benchmark', unit='run', dynamic_ncols=True) as bar:
      for dataset in bench.datasets:
        for temperature in bench.temperatures:
          for batch_size in bench.batch_sizes:
            self.run_sweep_point(dataset, float(temperature), int(batch_size), bar)
            report.write_json_atomic(os.path.join(self.out_dir, report.PARTIAL), self.rows)
      if bench.hf_peer:
        peer = self.run_peer(bar)
    meta = report.run_metadata(self.cfg, self.command, time.time() - started)
    meta.update(skipped=self.skipped, peer=peer, entropy=[
        {'dataset': d, 'temperature': t, **e} for (d, t), e in self.entropy.items()])
    report.write_outputs(self.out_dir, self.rows, meta)
    return self.rows


def run_benchmark(cfg, out_dir: str, command: str = '') -> list:
  """Runs the configured benchmark into `out_dir` (results.json, results.md, plots)."""
  return Benchmark(cfg, out_dir, command).run()
