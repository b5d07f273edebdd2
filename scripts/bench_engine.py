"""Engine overhead and training-free drafter speedups (issue: speculative engine performance).

  python scripts/bench_engine.py --preset=roofline100m --out=runs/bench_engine.json
  python scripts/bench_engine.py --checkpoint=demo/target \
      --out=docs/results/engine_overhead/bench_engine.json

1. Overhead: the oracle drafter replays the AR output with synthetic acceptance profiles.
   Measured speedup (AR decode time / speculative decode time) is compared with the model
   tau * T_ar / (T_verify(gamma + 1) + T_draft), whose parts are timed separately in the same
   process. Goal: measured within 10% of the model.
2. Prompt lookup and suffix decoding on code-editing prompts (the answer repeats prompt
   text), AR baseline in the same run. Goal: speedup > 1.5x.
3. `--no_proposal`: the cost of an engine step whose drafter proposes nothing vs an AR step
   (goal: within 5%), at --batch_sizes, from a prompt of distinct tokens: the controller's
   tier 0 (`TruncatedDrafter(d, 0)`: verify width 1, the drafter's `idle_update`) for
   n-gram and for --learned drafters, n-gram at γ with no match (prompts of random tokens,
   redrawn until n-gram proposes nothing over the timed steps), and an empty γ-wide proposal
   (what a host drafter's device step verifies when it has nothing); for reference, a step
   that verifies γ drafts (the oracle, every draft rejected).
   `--steps` steps per timed run; the runs interleave the engines round by round (the CPU
   may be shared: same-process interleaved medians), and per-round ratios to AR's time of
   the same round are reported as medians too, for wall and for process CPU time.
All timings: warm-up first (compile excluded), then the median of --repeats runs.

  python scripts/bench_engine.py --checkpoint=demo/target --no_proposal \
      --learned=mtp:demo/mtp,dflash:demo/dflash --repeats=15
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

from configs import common  # noqa: E402
from dspec import cli, files  # noqa: E402

_OUT = flags.DEFINE_string('out', None, 'Write the results JSON here.')
_FORCE = flags.DEFINE_bool('force', False, 'Replace an --out file that dspec did not write.')
_PRESET = flags.DEFINE_string('preset', 'roofline100m', 'Random-weight model preset.')
_CHECKPOINT = flags.DEFINE_string('checkpoint', None, 'dspec target checkpoint instead.')
_NEW_TOKENS = flags.DEFINE_integer('new_tokens', 96, 'Tokens to generate per prompt.')
_GAMMA = flags.DEFINE_integer('gamma', 7, 'Draft length for the overhead study.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed runs (median reported).')
_NO_PROPOSAL = flags.DEFINE_bool('no_proposal', False, 'Measure steps whose drafter proposes '
                                 'nothing against AR steps instead (study 3).')
_BATCHES = flags.DEFINE_list('batch_sizes', ['1', '16'], 'Batch sizes of study 3.')
_STEPS = flags.DEFINE_integer('steps', 4, 'Engine steps per timed run (study 3; prompts are '
                              'drawn so that n-gram finds no match over them).')
_LEARNED = flags.DEFINE_list('learned', [], 'Study 3: learned drafters as name:path '
                             '(e.g. mtp:demo/mtp,dflash:demo/dflash), timed at tier 0.')

# Code-editing style: the answer is expected to repeat most of the prompt's code.
EDIT_PROMPT = '''# Rename the variable `total` to `acc` in this function.
def running_sum(values):
    total = 0
    out = []
    for v in values:
        total = total + v
        out.append(total)
    return out

# After the rename:
def running_sum(values):
'''


def _no_match_prompts(ngram_engine, params, batch: int, steps: int, new_tokens: int,
                      vocab: int, tries: int = 100) -> np.ndarray:
  """[batch, 64] prompts of distinct random tokens on which the n-gram engine proposes
  nothing for `steps` steps (rows that got a proposal are redrawn)."""
  rng = np.random.default_rng(0)
  draw = lambda: rng.choice(np.arange(3, vocab), 64, replace=False).astype(np.int32)
  prompt = np.stack([draw() for _ in range(batch)])
  lens = np.full((batch,), prompt.shape[1], np.int32)
  for _ in range(tries):
    state = ngram_engine.prefill(params, None, prompt, lens, max_new_tokens=new_tokens)
    proposed = np.asarray(ngram_engine.run(params, None, state, steps).stats.proposed_B)
    if not proposed.any():
      return prompt
    for r in np.nonzero(proposed)[0]:
      prompt[r] = draw()
  raise ValueError(f'no {batch} prompts without an n-gram match over {steps} steps in '
                   f'{tries} tries; try fewer --steps')


def no_proposal_study(cfg, target, graphdef, params, stop_ids) -> dict:
  """Per-step seconds of engines that propose nothing vs AR (study 3)."""
  import statistics
  import time

  import jax

  from dspec.decoding.drafter import TruncatedDrafter
  from dspec.decoding.drafters import registry
  from dspec.decoding.drafters.ngram import NgramDrafter
  from dspec.decoding.drafters.oracle import OracleDrafter
  from dspec.decoding.drafters.suffix import SuffixDrafter
  from dspec.decoding.runner import speculative_engine

  g, steps = _GAMMA.value, _STEPS.value
  if not 1 <= steps < _NEW_TOKENS.value:
    raise ValueError(f'--steps must be in [1, --new_tokens), got {steps}')
  ngram = NgramDrafter(num_draft=g, min_n=1, max_n=4)
  drafters = {'ar': (None, None), 'ngram tier 0': (TruncatedDrafter(ngram, 0), None)}
  for entry in _LEARNED.value:
    name, _, path = entry.partition(':')
    if name not in cfg.drafters or not path:
      raise ValueError(f'--learned takes name:path entries, got {entry!r}')
    cfg.drafter, cfg.drafters[name].path = name, path
    inner, dparams = registry.build_drafter(cfg, target)
    drafters[f'{name} tier 0'] = (TruncatedDrafter(inner, 0), dparams)
  drafters[f'ngram γ={g}, no match'] = (ngram, None)
  # What a host drafter's device step runs when it has nothing: width γ + 1, no search.
  drafters[f'empty γ={g} proposal'] = (SuffixDrafter(num_draft=g), None)
  # For reference, a step that does verify γ drafts (all rejected: one token per step).
  drafters[f'oracle γ={g}, verified'] = (OracleDrafter(num_draft=g, acceptance=(0.0,)), None)
  engines = {m: (speculative_engine(graphdef, d, stop_ids=stop_ids, verify_length='fixed'), p)
             for m, (d, p) in drafters.items()}
  out = {'gamma': g, 'steps_per_run': steps, 'repeats': _REPEATS.value, 'batch': {}}
  for b in (int(x) for x in _BATCHES.value):
    prompt = _no_match_prompts(engines[f'ngram γ={g}, no match'][0], params, b, steps,
                               _NEW_TOKENS.value, target.cfg.vocab_size)
    lens = np.full((b,), prompt.shape[1], np.int32)
    # Buffers sized for --new_tokens, as a generation's (γ slots longer than AR's).
    states = {m: e.prefill(params, p, prompt, lens, max_new_tokens=_NEW_TOKENS.value)
              for m, (e, p) in engines.items()}
    # Wall and process CPU seconds per step: on a shared CPU the CPU time is the steadier.
    times = {(m, clock): [] for m in engines for clock in ('wall', 'cpu')}
    proposed = {}
    for r in range(_REPEATS.value + 1):     # round 0 compiles
      for m, (e, p) in engines.items():
        state = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), states[m]))
        t0, c0 = time.perf_counter(), time.process_time()
        end = jax.block_until_ready(e.run(params, p, state, steps))
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        done = max(int(end.step) - int(states[m].step), 1)
        proposed[m] = int(np.sum(end.stats.proposed_B))
        if r:
          times[m, 'wall'].append(dt / done)
          times[m, 'cpu'].append(dc / done)
    row = {}
    for m in engines:
      row[m] = {'proposed_tokens': proposed[m]}
      for clock in ('wall', 'cpu'):
        ratios = [t / a for t, a in zip(times[m, clock], times['ar', clock])]
        row[m].update({f'{clock}_step_ms': 1e3 * statistics.median(times[m, clock]),
                       f'{clock}_over_ar': statistics.median(ratios)})
      print(f'B={b:3d} {m:24s} wall {row[m]["wall_step_ms"]:8.3f} ms/step '
            f'{row[m]["wall_over_ar"]:.3f}× AR, cpu {row[m]["cpu_step_ms"]:8.3f} ms/step '
            f'{row[m]["cpu_over_ar"]:.3f}× AR (proposed {proposed[m]})', flush=True)
    out['batch'][str(b)] = row
    jax.clear_caches()
  return out


def main(argv):
  del argv
  files.check_outputs({'--out': _OUT.value}, {'--checkpoint': _CHECKPOINT.value},
                      force=_FORCE.value)
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from dspec.bench.timing import median_time
  from dspec.decoding.drafters.ngram import NgramDrafter
  from dspec.decoding.drafters.oracle import OracleDrafter
  from dspec.decoding.drafters.suffix import SuffixDrafter
  from dspec.decoding import runner
  from dspec.decoding.runner import speculative_engine
  from dspec.metrics import acceptance_metrics

  cfg = common.decode_config(_PRESET.value if not _CHECKPOINT.value else 'tiny')
  if _CHECKPOINT.value:
    cfg.model.source, cfg.model.path = 'checkpoint', _CHECKPOINT.value
  from dspec.loading import build_target
  target, tokenizer, _ = build_target(cfg.model)
  graphdef, params = nnx.split(target)
  if tokenizer.vocab_size >= 1000:
    ids = tokenizer.encode(EDIT_PROMPT)
  else:   # random-weight presets: a repetitive id pattern instead of text
    ids = (list(range(3, 40)) * 3)[:96]
  prompt = np.asarray([ids], np.int32)
  lens = np.array([len(ids)], np.int32)
  n = _NEW_TOKENS.value
  stop_ids = tuple(tokenizer.stop_ids) if _CHECKPOINT.value else ()

  def run(engine, dparams=None):
    settings = runner.Settings(max_new_tokens=n)
    go = lambda: runner.run_generation(engine, params, dparams, prompt, lens, settings)[0]
    state = go()
    t = median_time(go, repeats=_REPEATS.value, warmup=0)
    return state, t

  if _NO_PROPOSAL.value:
    result = {'model': _CHECKPOINT.value or _PRESET.value,
              'no_proposal': no_proposal_study(cfg, target, graphdef, params, stop_ids)}
    print(json.dumps(result, indent=1))
    if _OUT.value:
      files.write_json_atomic(_OUT.value, files.mark(result, 'bench_engine'))
    return

  ar_engine = speculative_engine(graphdef, stop_ids=stop_ids)
  ar_state, t_ar_total = run(ar_engine)
  new = int(ar_state.num_tokens_B[0] - ar_state.prompt_len_B[0])
  t_prefill = median_time(lambda: ar_engine.prefill(params, None, prompt, lens,
                                                    max_new_tokens=n), _REPEATS.value)
  t_ar = (t_ar_total - t_prefill) / new
  result = {'model': _CHECKPOINT.value or _PRESET.value, 'new_tokens': new,
            'ar_tokens_per_s': new / (t_ar_total - t_prefill), 'ar_step_ms': t_ar * 1e3}

  # --- Separately timed parts: one verify forward of gamma + 1 tokens mid-sequence.
  g = _GAMMA.value
  cache = ar_state.cache

  @jax.jit
  def verify(p, tokens, cache):
    return nnx.merge(graphdef, p)(tokens, cache=cache).logits_BTV

  mid = cache.with_lengths(jnp.asarray(lens + new // 2))
  t_verify = median_time(lambda: verify(params, jnp.zeros((1, g + 1), jnp.int32), mid),
                         _REPEATS.value * 3, warmup=2)
  result['verify_ms'] = {str(g + 1): t_verify * 1e3}

  overhead = []
  for profile in ([1.0], [0.9], [0.8, 0.5], [0.5]):
    drafter = OracleDrafter(num_draft=g, acceptance=tuple(profile))
    engine = speculative_engine(graphdef, drafter, stop_ids=stop_ids, verify_length='fixed')
    ref = ar_state.tokens_BL
    state, t_spec_total = run(engine)
    assert np.array_equal(np.asarray(state.tokens_BL)[0, :lens[0] + new],
                          np.asarray(ref)[0, :lens[0] + new]), 'oracle run not lossless'
    tau = acceptance_metrics(state.stats)['tau']
    ctx_key = jax.random.key(0)
    propose = jax.jit(lambda p, st: drafter.propose(
        None, st.drafter_state, nnx.merge(graphdef, p), engine.context(st),
        ctx_key).tokens_BG)
    t_draft = median_time(lambda: propose(params, state), _REPEATS.value * 3, warmup=2)
    measured = (t_ar_total - t_prefill) / (t_spec_total - t_prefill)
    modelled = tau * t_ar / (t_verify + t_draft)
    overhead.append({'profile': profile, 'tau': tau, 'draft_ms': t_draft * 1e3,
                     'measured_speedup': measured, 'model_speedup': modelled,
                     'measured_over_model': measured / modelled})
  result['oracle_overhead'] = overhead

  drafters = {'ngram': NgramDrafter(num_draft=g, min_n=1, max_n=4),
              'suffix': SuffixDrafter(num_draft=16, use_global_cache=False)}
  result['training_free'] = {}
  for name, drafter in drafters.items():
    engine = speculative_engine(graphdef, drafter, stop_ids=stop_ids, verify_length='fixed')
    state, t_total = run(engine)
    lossless = np.array_equal(np.asarray(state.tokens_BL)[0, :lens[0] + new],
                              np.asarray(ar_state.tokens_BL)[0, :lens[0] + new])
    m = acceptance_metrics(state.stats)
    result['training_free'][name] = {
        'tau': m['tau'], 'acceptance_rate': m['acceptance_rate'],
        'speedup': (t_ar_total - t_prefill) / (t_total - t_prefill), 'lossless': lossless}
  print(json.dumps(result, indent=1))
  if _OUT.value:
    files.write_json_atomic(_OUT.value, files.mark(result, 'bench_engine'))


if __name__ == '__main__':
  cli.run(main)
