"""Decode with a target and a drafter: python scripts/decode.py --config=configs/<x>.py.

Prints the prompt, the generated continuation and one metrics line (status lines for each
phase go to stderr; `--quiet` drops them, `--verbosity=1` shows library logs).
`--metrics_json=PATH` writes every docs/DESIGN.md key (method, temperature, new_tokens, tau,
acceptance_rate, per_position_acceptance, acceptance_lengths, tokens_per_s,
ar_tokens_per_s, speedup, lossless, output_ids, ...); `--trace_json=PATH` writes row 0's
per-step trace (proposed tokens, accepted count, committed tokens). Structured output:
`--json_schema=FILE`, `--regex=RE` or `--grammar=FILE` (Lark) constrains every prompt's
output (lossless against constrained AR; `--noforced_drafts` stops drafting the tokens the
constraint forces); the metrics line then says whether the output completed the match.
Bad input ends with one
`error: ...` line and exit code 1; JSON files are written atomically, and an existing file is
replaced only when dspec wrote it (else `--force`); both paths are checked before decoding.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from dspec import cli, config_checks, console  # noqa: E402

_CONFIG = cli.define_config('configs/demo.py', 'Decode config file.')
_PROMPT = flags.DEFINE_multi_string('prompt', None, 'Prompt text (repeat for a batch).')
_PROMPT_IDS = flags.DEFINE_string('prompt_ids', None, 'Comma-separated prompt token ids.')
_METRICS_JSON = flags.DEFINE_string('metrics_json', None, 'Where to write the metrics JSON.')
_TRACE_JSON = flags.DEFINE_string('trace_json', None, "Where to write row 0's step trace.")
_JSON_SCHEMA = flags.DEFINE_string('json_schema', None, 'Structured output: a JSON schema '
                                   'file every output follows.')
_REGEX = flags.DEFINE_string('regex', None, 'Structured output: a regular expression every '
                             'output matches whole.')
_GRAMMAR = flags.DEFINE_string('grammar', None, 'Structured output: a Lark grammar file '
                               "(llguidance's dialect) every output follows.")
_FORCED_DRAFTS = flags.DEFINE_bool('forced_drafts', True, 'Under a constraint, draft the '
                                   'tokens it forces.')
_FORCE = flags.DEFINE_bool('force', False, 'Replace --metrics_json / --trace_json files that '
                           'dspec did not write.')

_METRIC_KEYS = ('method', 'temperature', 'new_tokens', 'tau', 'acceptance_rate',
                'tokens_per_s', 'ar_tokens_per_s', 'speedup', 'lossless', 'compile_s')


def _parse_ids(text: str) -> list:
  try:
    return [int(t) for t in text.split(',') if t.strip()]
  except ValueError:
    raise cli.UserError(f'--prompt_ids must be comma-separated integers, got {text!r}')


def _constraint():
  """The --json_schema / --regex / --grammar constraint (files read), or None."""
  from dspec.structured import Constraint
  sources = {}
  for name, flag in (('json_schema', _JSON_SCHEMA), ('grammar', _GRAMMAR)):
    if flag.value is not None:
      try:
        with open(flag.value, encoding='utf-8') as f:
          sources[name] = f.read()
      except (OSError, UnicodeDecodeError) as e:
        raise cli.UserError(f'--{name}={flag.value}: cannot read it ({e})') from None
  if _REGEX.value is not None:
    sources['regex'] = _REGEX.value
  if len(sources) > 1:
    raise cli.UserError(f'give one of --json_schema, --regex and --grammar, got '
                        f'{" and ".join("--" + k for k in sources)}')
  if not sources and not _FORCED_DRAFTS.value:
    raise cli.UserError('--noforced_drafts needs a constraint (--json_schema, --regex or '
                        '--grammar)')
  return Constraint.of(**sources)


def main(argv):
  del argv
  from dspec import sharding
  status = console.configure()
  sharding.maybe_initialize_distributed(_CONFIG.value.get('distributed', False))
  from dspec import files  # heavy imports after flag parsing
  from dspec.decoding import runner
  cfg = _CONFIG.value
  config_checks.require_sections(cfg, ('drafter', 'drafters', 'model'), 'scripts/decode.py',
                                 flags.FLAGS['config'].config_filename)
  if _PROMPT_IDS.value is not None and _PROMPT.value:
    raise cli.UserError('give either --prompt or --prompt_ids, not both')
  files.check_outputs({'--metrics_json': _METRICS_JSON.value,
                       '--trace_json': _TRACE_JSON.value},
                      files.config_inputs(cfg), force=_FORCE.value)
  prompts = [_parse_ids(_PROMPT_IDS.value)] if _PROMPT_IDS.value is not None else _PROMPT.value
  constraint = _constraint()
  report = runner.run_decode(cfg, prompts, trace=bool(_TRACE_JSON.value), progress=status,
                             constraint=constraint, forced_drafts=_FORCED_DRAFTS.value)
  keys = _METRIC_KEYS + (('constraint_complete',) if constraint else ())
  print(f"prompt:\n{report['prompt']}\n----- continuation -----\n{report['text']}\n"
        '------------------------')
  print('metrics: ' + ' '.join(
      f'{k}={report[k]:.3f}' if isinstance(report[k], float) else f'{k}={report[k]}'
      for k in keys))
  if _TRACE_JSON.value:
    files.write_json_atomic(_TRACE_JSON.value, files.mark(report.pop('trace'), 'decode trace'))
  if _METRICS_JSON.value:
    files.write_json_atomic(_METRICS_JSON.value, files.mark(report, 'decode metrics'))


if __name__ == '__main__':
  cli.run(main)
