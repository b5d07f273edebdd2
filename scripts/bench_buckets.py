"""Many generate calls in one process: python scripts/bench_buckets.py [--calls=100].

What a notebook does: the target and drafter (--drafter=mtp:demo/mtp) are loaded once,
warmed up (`dspec.warmup`, per --max_new_tokens value, on the prompt lengths the calls
use; --nowarmup skips it), then `generate` runs --calls times on HumanEval prompts cut to
as many distinct lengths (8, 10, 12, ... tokens), max_new_tokens cycling through
--max_new_tokens, under --verify_length. Reports the XLA compiles (of the warm-up, of the
calls), per-call seconds, the largest ratio of a call's wall time to its own prefill +
decode time (a compile or profile inside a call raises it), and memory mappings
(/proc/self/maps lines) and RSS after the warm-up and after the last call. The persistent
compilation cache is off by default here, as in a notebook, so a compile is not a load from
disk.
Expected: one JSON line, e.g.
  {"calls": 100, "warmup_compiles": 120, "call_compiles": 0, "call_s_median": 0.4, ...}
and with --out the same JSON with every call's seconds and compiles.
"""

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from dspec import cli, files  # noqa: E402
from dspec.errors import UserError  # noqa: E402

_TARGET = flags.DEFINE_string('target', 'demo/target', 'The target checkpoint.')
_DRAFTER = flags.DEFINE_string('drafter', 'mtp:demo/mtp', 'kind:checkpoint (or a kind '
                               'without one, e.g. ngram; "none": AR).')
_CALLS = flags.DEFINE_integer('calls', 100, 'generate calls, each on a new prompt length.',
                              lower_bound=1)
_MAX_NEW_TOKENS = flags.DEFINE_list('max_new_tokens', ['16', '32', '64'],
                                    'Budgets the calls cycle through.')
_VERIFY_LENGTH = flags.DEFINE_string('verify_length', 'auto', 'auto | fixed | tree | '
                                     'auto_tree.')
_WARMUP = flags.DEFINE_bool('warmup', True, 'Warm the buckets up before the calls.')
_OUT = flags.DEFINE_string('out', None, 'Where to write the report (JSON).')
_FORCE = flags.DEFINE_bool('force', False, 'Replace an --out file that dspec did not write.')
flags.FLAGS.set_default('compilation_cache_dir', '')


def _rss_mb() -> float:
  with open('/proc/self/status') as f:
    kb = next(int(line.split()[1]) for line in f if line.startswith('VmRSS:'))
  return kb / 1024


def main(argv):
  del argv
  files.check_outputs({'--out': _OUT.value}, {'--target': _TARGET.value, '--drafter':
                      _DRAFTER.value.partition(':')[2], 'prompt folder': 'data'},
                      force=_FORCE.value)
  try:
    budgets = [int(n) for n in _MAX_NEW_TOKENS.value]
  except ValueError:
    raise UserError(f'--max_new_tokens: {_MAX_NEW_TOKENS.value} are not integers') from None
  import dspec
  from dspec import datasets
  from dspec.compiled_programs import counting_compiles, memory_map_count
  target = dspec.load_target(_TARGET.value)
  kind, _, path = _DRAFTER.value.partition(':')
  drafter = None if kind == 'none' else dspec.load_drafter(kind, path or None, target=target)
  text = ''.join(datasets.load_prompts('humaneval', 'data'))
  lengths = [8 + 2 * i for i in range(_CALLS.value)]
  ids = target.tokenizer.encode(text)
  if len(ids) < lengths[-1]:
    raise UserError(f'--calls={_CALLS.value}: HumanEval has {len(ids)} tokens, fewer than '
                    f'the longest prompt ({lengths[-1]})')
  report = {'target': _TARGET.value, 'drafter': _DRAFTER.value,
            'verify_length': _VERIFY_LENGTH.value, 'calls': _CALLS.value,
            'max_new_tokens': budgets}
  t0 = time.perf_counter()
  with counting_compiles() as compiled:
    if _WARMUP.value:
      for budget in budgets:
        dspec.warmup(target, drafter, prompt_lengths=lengths, max_new_tokens=budget,
                     verify_length=_VERIFY_LENGTH.value)
  report.update(warmup_s=time.perf_counter() - t0, warmup_compiles=len(compiled),
                maps_after_warmup=memory_map_count(), rss_mb_after_warmup=_rss_mb())
  seconds, own, compiles = [], [], []
  for i, length in enumerate(lengths):
    t = time.perf_counter()
    with counting_compiles() as compiled:
      out = dspec.generate(target, [ids[:length]], drafter,
                           max_new_tokens=budgets[i % len(budgets)],
                           verify_length=_VERIFY_LENGTH.value)
    seconds.append(time.perf_counter() - t)
    own.append(out.metrics['ttft_s'] + out.metrics['decode_s'])
    compiles.append(len(compiled))
  report.update(call_compiles=sum(compiles), call_s_median=statistics.median(seconds),
                call_s_max=max(seconds),
                call_over_own_max=max(s / o for s, o in zip(seconds, own)),
                maps_after_calls=memory_map_count(),
                rss_mb_after_calls=_rss_mb())
  print(json.dumps(report), flush=True)
  if _OUT.value:
    files.write_json_atomic(_OUT.value, files.mark(
        dict(report, call_s=seconds, call_compiles_each=compiles), 'bench_buckets'))


if __name__ == '__main__':
  cli.run(main)
