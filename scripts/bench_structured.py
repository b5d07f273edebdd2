"""Structured output: validity of constrained vs plain output, and its speed under speculation.

  python scripts/bench_structured.py [--out=docs/results/structured_output]
  python scripts/bench_structured.py --num_prompts=8 --max_new_tokens=48 \
      --wide_prompts=1 --wide_max_new_tokens=32 --timing_repeats=1 --out=runs/so  # quick

1. Validity (--target, the small cache-resident demo target; T = 0, all --num_prompts
   prompts in one batch, --max_new_tokens each): GSM8K test questions (a) continued in
   GSM8K's own format, the constraint the regex GSM8K_REGEX (reasoning of at most 200
   characters without '#', about the length of the plain outputs that finish, then
   "\\n#### <integer>"), and (b) asked to answer in a JSON object, the constraint
   JSON_SCHEMA ({"answer": integer 0..10^9, "unit": string of at most 16 characters}, both
   required, nothing else). Each is decoded plain (AR), constrained (AR) and constrained
   with --drafter (MTP). valid: the text fullmatches the regex (`re.fullmatch`) / parses
   as JSON and meets the schema (checked here in Python); complete: the constraint's
   matcher finished (`metrics['constraint_complete']`); gold: the integer answer equals
   GSM8K's; lossless: the drafter's ids equal constrained AR's. The budget must fit the
   regex's cap: digit-heavy text runs 1.7 characters per token, so 200 characters can
   take ~120 tokens (at 96, 2 of 60 constrained outputs ended inside the reasoning).
2. Speed (the same target widened --widen_mlp times: memory-bound, ~50 ms per AR token on
   one core; --skip_wide skips it): B = 1, T = 0, verify_length=fixed, on the first
   --wide_prompts prompts of each set, every method of a set run on the same prompt with
   their timed runs interleaved round by round (`runner.timed_generations`, as generate's
   compare_ar; --timing_repeats rounds after a warm-up): (a) GSM8K regex: AR and the
   drafter, each unconstrained and constrained; (b) JSON schema: constrained AR vs drafter
   `grammar` (the forced tokens alone; one row per --grammar_num_draft) vs the drafter with
   forced drafts vs without (forced_drafts=False). tokens/s and speedups pool the prompts
   (tokens / decode seconds summed); speedup and lossless are against AR under the same
   constraint (or none).
Goals: (a) constrained ≥ 0.9× unconstrained tokens/s; (b) forced-token drafting ≥ 1.5× the
tokens/s of constrained AR.
Writes structured.json (every run's metrics and texts) and structured.md (tables, goals).
Expected (one core, 60 prompts, 128 + 96 tokens, 4 wide prompts; ~10-30 min):
valid plain 0.22 (regex) / 0.0 (JSON) vs 1.0 constrained, complete 1.0, lossless True;
wide: (a) constrained/unconstrained ~0.9×, (b) grammar ~1.6× constrained AR.
"""

import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from dspec import cli, files  # noqa: E402
from dspec.errors import UserError  # noqa: E402

_TARGET = flags.DEFINE_string('target', 'demo/target', 'The target checkpoint.')
_DRAFTER = flags.DEFINE_string('drafter', 'mtp:demo/mtp', 'The learned drafter, '
                               'kind:checkpoint.')
_NUM_PROMPTS = flags.DEFINE_integer('num_prompts', 60, 'Validity: prompts per set (one '
                                    'batch).', lower_bound=1)
_MAX_NEW_TOKENS = flags.DEFINE_integer('max_new_tokens', 128, 'Validity: tokens per prompt.',
                                       lower_bound=1)
_WIDEN = flags.DEFINE_integer('widen_mlp', 16, 'Speed: the target widened this many times.',
                              lower_bound=1)
_WIDE_PROMPTS = flags.DEFINE_integer('wide_prompts', 4, 'Speed: prompts per set (B = 1 '
                                     'each).', lower_bound=1)
_WIDE_MAX_NEW = flags.DEFINE_integer('wide_max_new_tokens', 96, 'Speed: tokens per prompt.',
                                     lower_bound=1)
_REPEATS = flags.DEFINE_integer('timing_repeats', 3, 'Speed: timed runs after the warm-up.',
                                lower_bound=1)
_GRAMMAR_DRAFTS = flags.DEFINE_multi_integer(
    'grammar_num_draft', [16, 4], 'Speed: num_draft of drafter grammar (one row each; 16 is '
    'its default).')
_SKIP_WIDE = flags.DEFINE_bool('skip_wide', False, 'Skip the speed part.')
_OUT = flags.DEFINE_string('out', 'docs/results/structured_output', 'Output folder '
                           '(structured.json, structured.md).')
_FORCE = flags.DEFINE_bool('force', False, 'Write into an --out folder dspec did not write.')
DATA_DIR = 'data'

# GSM8K's answer format: reasoning (no '#'), then the final line "#### <integer>".
GSM8K_REGEX = r'[^#]{1,200}\n#### [0-9]{1,9}'
GSM8K_LOOSE = r'[^#]+\n#### [0-9]{1,9}'
JSON_SCHEMA = {
    'type': 'object',
    'properties': {'answer': {'type': 'integer', 'minimum': 0, 'maximum': 10**9},
                   'unit': {'type': 'string', 'maxLength': 16}},
    'required': ['answer', 'unit'], 'additionalProperties': False}
JSON_INSTRUCTION = ('\nAnswer in JSON with the keys "answer" (an integer) and "unit" (a '
                    'word):')


def _is_ours(out_dir: str) -> bool:
  """An earlier --out: its structured.json carries dspec's mark."""
  return files.written_by_dspec(os.path.join(out_dir, 'structured.json'))


def regex_valid(text: str) -> bool:
  return re.fullmatch(GSM8K_REGEX, text) is not None


def gsm8k_format(text: str) -> bool:
  """GSM8K's format at any length (GSM8K_REGEX without its 200-character cap)."""
  return re.fullmatch(GSM8K_LOOSE, text) is not None


def json_valid(text: str) -> bool:
  """Parses as JSON and meets JSON_SCHEMA (checked by hand: no jsonschema dependency)."""
  try:
    obj = json.loads(text)
  except ValueError:
    return False
  if not isinstance(obj, dict) or set(obj) != {'answer', 'unit'}:
    return False
  answer, unit = obj['answer'], obj['unit']
  return (isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer <= 10**9
          and isinstance(unit, str) and len(unit) <= 16)


def regex_answer(text: str):
  """The integer after the last '#### ' (plain or constrained), else None."""
  found = re.findall(r'\n#### ([0-9][0-9,]*)', text)
  return int(found[-1].replace(',', '')) if found else None


def json_answer(text: str):
  try:
    obj = json.loads(text)
  except ValueError:
    return None
  answer = obj.get('answer') if isinstance(obj, dict) else None
  return answer if isinstance(answer, int) and not isinstance(answer, bool) else None


def gold_answers(limit: int) -> list:
  from dspec import datasets
  path = datasets.resolve_data_dir(DATA_DIR) / 'gsm8k' / 'test.jsonl'
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()][:limit]
  return [(row['question'],
           int(row['answer'].rpartition('####')[2].strip().replace(',', ''))) for row in rows]


def _summary(metrics: dict) -> dict:
  keep = ('tau', 'tokens_per_s', 'ar_tokens_per_s', 'speedup', 'lossless', 'new_tokens',
          'decode_s', 'ar_decode_s', 'constraint_host_ms_per_step', 'verify_steps',
          'acceptance_rate', 'verify_length', 'num_draft')
  return {k: metrics[k] for k in keep if k in metrics}


def validity(target, drafter, sets: dict) -> dict:
  """Part 1: per set, plain AR / constrained AR / constrained drafter, one batch each."""
  import dspec
  out = {}
  for name, (prompts, gold, constraint, valid, answer, loose) in sets.items():
    runs = {}
    for method, d, kw in (('plain AR', None, {}), ('constrained AR', None, constraint),
                          ('constrained ' + drafter.kind, drafter, constraint)):
      t = time.perf_counter()
      r = dspec.generate(target, prompts, d, max_new_tokens=_MAX_NEW_TOKENS.value, **kw)
      ok = [valid(x) for x in r.texts]
      fmt = [loose(x) for x in r.texts]
      got = [answer(x) for x in r.texts]
      complete = r.metrics.get('constraint_complete')
      runs[method] = {
          'valid': sum(ok) / len(ok), 'valid_loose': sum(fmt) / len(fmt),
          'complete': None if complete is None else sum(map(bool, complete)) / len(complete),
          'gold': sum(g == a for g, a in zip(gold, got)) / len(gold),
          'stopped_by_budget': sum(len(i) >= _MAX_NEW_TOKENS.value for i in r.ids) / len(ok),
          'mean_new_tokens': sum(map(len, r.ids)) / len(ok),
          'wall_s': time.perf_counter() - t, **_summary(r.metrics),
          'texts': r.texts, 'ids': r.ids, 'valid_each': ok}
      print(json.dumps({'set': name, 'method': method, **{
          k: v for k, v in runs[method].items() if k not in ('texts', 'ids', 'valid_each')}}),
            flush=True)
    ar, spec = runs['constrained AR'], runs['constrained ' + drafter.kind]
    spec['lossless'] = spec['ids'] == ar['ids']
    out[name] = runs
  return out


def interleaved(target, prompt, methods: list, repeats: int) -> dict:
  """{method: metrics} of `methods` ((name, `dspec.Drafter` or None, constraint kwargs or
  None, forced_drafts)) decoding `prompt` (B = 1, T = 0, fixed verification) with their
  timed runs interleaved round by round (`runner.timed_generations`, as `generate`'s
  compare_ar), so that the shared core's load falls on all alike; `lossless`: ids equal
  those of the first AR method under the same constraint."""
  from dspec.decoding import drafter as drafter_lib
  from dspec.decoding import runner
  from dspec.decoding.prompts import bucket_shapes, encode_prompts, generated_ids, pad_prompts
  from dspec.metrics import acceptance_metrics
  import numpy as np
  from dspec.structured import Constraint
  settings = runner.Settings(max_new_tokens=_WIDE_MAX_NEW.value, timing_repeats=repeats)
  num_draft = max(d.num_draft for _, d, *_ in methods if d is not None)
  rows = encode_prompts([prompt], target.tokenizer, target.model.cfg.vocab_size,
                        target.max_seq_len, settings.max_new_tokens, num_draft)
  width, buffer_len = bucket_shapes(len(rows[0]), settings.max_new_tokens,
                                    target.max_seq_len)
  prompt_BP, prompt_len_B = pad_prompts(rows, 1, min_width=width)
  graphdef, target_params = target.split()
  stop_ids = tuple(target.tokenizer.stop_ids)
  generations = []
  for _, d, constraint, forced in methods:
    drafter = d.drafter if d is not None else drafter_lib.NoDrafter()
    constraints = constraint and Constraint.of(**constraint)
    constrained = runner.constrained_run(target, constraints, 1, 'fixed', drafter,
                                         forced)
    engine = runner.speculative_engine(graphdef, drafter, settings.sampling(), stop_ids,
                                       verify_length='fixed')
    generations.append(runner.Generation(engine, target_params, d and d.params,
                                         constrained=constrained))
  results = runner.timed_generations(generations, prompt_BP, prompt_len_B, settings,
                                     buffer_len)
  out, ar_ids = {}, {}
  for (name, d, constraint, _), g, r in zip(methods, generations, results):
    state = r['state']
    ids = generated_ids(state)[0]
    key = json.dumps(constraint, sort_keys=True)
    if d is None:
      ar_ids.setdefault(key, (ids, r['decode_s_rounds']))
    m = acceptance_metrics(state.stats)
    row = {'tau': m['tau'], 'verify_steps': m['verify_steps'],
           'acceptance_rate': m['acceptance_rate'], 'new_tokens': r['new_tokens'],
           'decode_s': r['decode_s'], 'decode_s_rounds': r['decode_s_rounds'],
           'tokens_per_s': r['tokens_per_s'], 'num_draft': d.num_draft if d else 0,
           'constrained': constraint is not None,
           'text': target.tokenizer.decode(ids)}
    if g.constrained is not None:
      rows_run = g.constrained.last
      row['constraint_complete'] = rows_run.complete()[0]
      row['constraint_host_ms_per_step'] = 1e3 * rows_run.host_s / max(
          int(np.max(state.stats.steps_B)), 1)
    if key in ar_ids:
      ref, ar_rounds = ar_ids[key]
      row['lossless'] = ids == ref
      row['ar_decode_s'] = statistics.median(ar_rounds)
      row['speedup_rounds'] = [a / b for a, b in zip(ar_rounds, r['decode_s_rounds'])]
    out[name] = row
  return out


def _pooled(rows: list) -> dict:
  """Tokens / decode seconds summed over the prompts; τ over their verify steps."""
  tokens = sum(r['new_tokens'] for r in rows)
  decode_s = sum(r['decode_s'] for r in rows)
  pooled = {'tokens_per_s': tokens / decode_s, 'new_tokens': tokens,
            'tau': sum(r['tau'] * r['verify_steps'] for r in rows) /
            max(sum(r['verify_steps'] for r in rows), 1),
            'lossless': all(r.get('lossless', True) for r in rows),
            'constraint_host_ms_per_step': None}
  if all(r.get('ar_decode_s') for r in rows):
    ar_s = sum(r['ar_decode_s'] for r in rows)
    pooled.update(ar_tokens_per_s=tokens / ar_s, speedup=ar_s / decode_s)
  host = [r['constraint_host_ms_per_step'] for r in rows
          if r.get('constraint_host_ms_per_step') is not None]
  if host:
    pooled['constraint_host_ms_per_step'] = sum(host) / len(host)
  return pooled


def speed(target, drafter, sets: dict) -> dict:
  """Part 2: B = 1 per prompt, fixed verification, each set's methods interleaved."""
  import dspec
  kind = drafter.kind
  regex, schema = sets['gsm8k_regex'][2], sets['json_schema'][2]
  grammars = [(f'grammar (forced tokens), num_draft={n}',
               dspec.load_drafter('grammar', target=target, num_draft=n), schema, True)
              for n in _GRAMMAR_DRAFTS.value]
  plans = {'gsm8k_regex': [('AR', None, None, True), ('AR constrained', None, regex, True),
                           (f'{kind} unconstrained', drafter, None, True),
                           (f'{kind} constrained', drafter, regex, True)],
           'json_schema': [('AR constrained', None, schema, True), *grammars,
                           (f'{kind} + forced drafts', drafter, schema, True),
                           (f'{kind}, forced_drafts=False', drafter, schema, False)]}
  out = {}
  for name, methods in plans.items():
    prompts = sets[name][0]
    per = {m: [] for m, *_ in methods}
    for i, prompt in enumerate(prompts[:_WIDE_PROMPTS.value]):
      rows = interleaved(target, prompt, methods, _REPEATS.value)
      for method, row in rows.items():
        per[method].append(dict(row, prompt=i))
        print(json.dumps({'set': name, 'method': method, 'prompt': i, **{
            k: v for k, v in row.items() if k != 'text'}}), flush=True)
    out[name] = {m: {'pooled': _pooled(rows), 'per_prompt': rows} for m, rows in per.items()}
  a, b = out['gsm8k_regex'], out['json_schema']
  tps = lambda runs, m: runs[m]['pooled']['tokens_per_s']
  ratio = tps(a, f'{kind} constrained') / tps(a, f'{kind} unconstrained')
  forced = {m: b[m]['pooled']['speedup'] for m in b if m != 'AR constrained'}
  out['goals'] = {
      'constrained_vs_unconstrained_tokens_per_s': ratio, 'goal_a': 0.9,
      'met_a': ratio >= 0.9,
      'ar_constrained_vs_unconstrained_tokens_per_s': tps(a, 'AR constrained') / tps(a, 'AR'),
      'json_tokens_per_s_over_constrained_ar': forced, 'goal_b': 1.5,
      'met_b': max(v for m, v in forced.items() if 'forced_drafts=False' not in m) >= 1.5}
  return out


def _f(x, digits=2):
  return 'n/a' if x is None else f'{x:.{digits}f}'


def _no_forced(forced: dict):
  return next((m for m in forced if 'forced_drafts=False' in m), None)


def markdown(report: dict) -> str:
  lines = ['# Structured output', '',
           f"Command: `{report['command'].strip()}`", '',
           f"Machine: {report['device']}; one CPU core shared with another job (timings "
           'move with its load; ratios come from AR and the method interleaved in one '
           'process).', '',
           f"## Validity (small target `{report['target']}`, T = 0, "
           f"{report['num_prompts']} prompts in one batch, {report['max_new_tokens']} new "
           'tokens)', '',
           f"Regex: `{GSM8K_REGEX}`; JSON schema: `{json.dumps(JSON_SCHEMA)}`; JSON prompts: "
           f'the GSM8K question + `{JSON_INSTRUCTION.strip()}`.', '',
           'valid: fullmatches the regex / parses and meets the schema; GSM8K format: '
           f'fullmatches `{GSM8K_LOOSE}` (the regex without its 200-character cap; JSON: '
           '= valid); complete: the matcher finished; = gold: the integer answer is GSM8K\'s.',
           '', '| set | method | valid | GSM8K format | complete | = gold answer | hit the '
           'token budget | mean tokens | τ | lossless (ids = constrained AR) |',
           '|---|---|---|---|---|---|---|---|---|---|']
  for name, runs in report['validity'].items():
    for method, r in runs.items():
      lossless = r['lossless'] if method.startswith('constrained ') and method != (
          'constrained AR') else ''
      lines.append(f"| {name} | {method} | {_f(r['valid'])} | {_f(r['valid_loose'])} | "
                   f"{_f(r['complete'])} | "
                   f"{_f(r['gold'])} | {_f(r['stopped_by_budget'])} | "
                   f"{_f(r['mean_new_tokens'], 1)} | {_f(r['tau'])} | {lossless} |")
  for name, runs in report['validity'].items():
    lines += ['', f'Examples ({name}, prompt 0):', '']
    for method in ('plain AR', 'constrained AR'):
      lines.append(f"- {method}: `{json.dumps(runs[method]['texts'][0])[1:-1][:300]}`")
  if report.get('speed'):
    s = report['speed']
    g = s['goals']
    lines += ['', f"## Speed (wide target: `{report['target']}` × {report['widen_mlp']} "
              f"MLP, B = 1, T = 0, verify_length=fixed, {report['wide_prompts']} prompts per "
              f"set, {report['wide_max_new_tokens']} new tokens, {report['timing_repeats']} "
              'timed runs)', '',
              'Pooled over the prompts (tokens / decode seconds summed); speedup: over AR '
              'under the same constraint (or none), all methods of a set interleaved round '
              'by round in one process; lossless: ids equal that AR\'s.', '',
              '| set | method | new tokens | tokens/s | τ | speedup | constraint host '
              'ms/step | lossless |', '|---|---|---|---|---|---|---|---|']
    for name in ('gsm8k_regex', 'json_schema'):
      for method, r in s[name].items():
        p = r['pooled']
        lines.append(f"| {name} | {method} | {p['new_tokens']} | "
                     f"{_f(p['tokens_per_s'], 1)} | {_f(p['tau'])} | "
                     f"{_f(p.get('speedup'))}× | {_f(p['constraint_host_ms_per_step'])} | "
                     f"{p['lossless']} |")
    forced = g['json_tokens_per_s_over_constrained_ar']
    lines += ['', 'Goals:', '',
              f"- (a) constrained ≥ 0.9× unconstrained tokens/s (regex, {report['drafter']}): "
              f"{g['constrained_vs_unconstrained_tokens_per_s']:.2f}× — "
              f"{'met' if g['met_a'] else 'missed'} (AR alone: constrained "
              f"{g['ar_constrained_vs_unconstrained_tokens_per_s']:.2f}× unconstrained)",
              '- (b) forced-token drafting ≥ 1.5× constrained AR tokens/s (JSON): ' + ', '.join(
                  f"{m} {v:.2f}× ({'met' if v >= g['goal_b'] else 'missed'})"
                  for m, v in forced.items() if 'forced_drafts=False' not in m) +
              f" (without forced drafts: {_f(forced.get(_no_forced(forced)))}×)"]
  return '\n'.join(lines) + '\n'


def main(argv):
  del argv
  kind, _, path = _DRAFTER.value.partition(':')
  if not path:
    raise UserError(f'--drafter: {_DRAFTER.value!r} is not kind:checkpoint')
  files.check_outputs({'--out': _OUT.value}, {'--target': _TARGET.value,
                      '--drafter': path, 'prompt folder': DATA_DIR}, force=_FORCE.value,
                      dirs={'--out': _is_ours})
  import jax
  import dspec
  from dspec import datasets
  n = max(_NUM_PROMPTS.value, 0 if _SKIP_WIDE.value else _WIDE_PROMPTS.value)
  qa = gold_answers(n)
  gold = [a for _, a in qa]
  gsm8k = datasets.load_prompts('gsm8k_test', DATA_DIR, n)
  json_prompts = [f'Question: {q.strip()}{JSON_INSTRUCTION}' for q, _ in qa]
  sets = {'gsm8k_regex': (gsm8k, gold, {'regex': GSM8K_REGEX}, regex_valid, regex_answer,
                          gsm8k_format),
          'json_schema': (json_prompts, gold, {'json_schema': JSON_SCHEMA}, json_valid,
                          json_answer, json_valid)}
  t0 = time.perf_counter()
  report = {'command': ' '.join(['python scripts/bench_structured.py', *sys.argv[1:]]),
            'device': f'{jax.devices()[0]}', 'target': _TARGET.value,
            'drafter': _DRAFTER.value, 'num_prompts': _NUM_PROMPTS.value,
            'max_new_tokens': _MAX_NEW_TOKENS.value, 'widen_mlp': _WIDEN.value,
            'wide_prompts': _WIDE_PROMPTS.value,
            'wide_max_new_tokens': _WIDE_MAX_NEW.value,
            'timing_repeats': _REPEATS.value, 'regex': GSM8K_REGEX,
            'json_schema': JSON_SCHEMA, 'json_instruction': JSON_INSTRUCTION}
  small = dspec.load_target(_TARGET.value)
  drafter = dspec.load_drafter(kind, path, target=small)
  cut = {name: (v[0][:_NUM_PROMPTS.value], v[1][:_NUM_PROMPTS.value], *v[2:])
         for name, v in sets.items()}
  report['validity'] = validity(small, drafter, cut)
  report['validity_s'] = time.perf_counter() - t0
  if not _SKIP_WIDE.value:
    del small, drafter
    jax.clear_caches()
    wide = dspec.load_target(_TARGET.value, widen_mlp=_WIDEN.value)
    drafter = dspec.load_drafter(kind, path, target=wide)
    t1 = time.perf_counter()
    report['speed'] = speed(wide, drafter, sets)
    report['speed_s'] = time.perf_counter() - t1
  report['total_s'] = time.perf_counter() - t0
  files.write_json_atomic(os.path.join(_OUT.value, 'structured.json'),
                          files.mark(report, 'bench_structured'))
  text = markdown(report)
  files.write_text_atomic(os.path.join(_OUT.value, 'structured.md'), text)
  print(text)


if __name__ == '__main__':
  cli.run(main)
